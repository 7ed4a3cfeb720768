"""Checkpoints: atomic commit, keep-last, resume that continues training bit for bit (1 process
and FSDP2 on 2 ranks), a crash mid-save, and Hugging Face export."""
import os
import random

import pytest
import torch

from dist import torchrun
from hflow import checkpoint as ck

# ---------------------------------------------------------------- one process, no torch.distributed


def _tiny_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train_step(model, opt, sched):
    x = torch.randn(16, 4)                         # drawn from the RNG a checkpoint restores
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def test_resume_continues_training_exactly(tmp_path):
    model, opt, sched = _tiny_training(0)
    for _ in range(3):
        _train_step(model, opt, sched)
    random.seed(5)
    path = ck.save_checkpoint(tmp_path, 3, {"train": ck.ModelState(model, opt, sched), "rng": ck.RNGState()},
                              extra={"data_position": 48, "kl_coef": 0.05})
    expected = [_train_step(model, opt, sched) for _ in range(2)] + [random.random()]
    expected_params = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(123)                         # a fresh process would start elsewhere
    random.seed(123)
    model2, opt2, sched2 = _tiny_training(seed=1)
    extra = ck.load_checkpoint(ck.latest_checkpoint(tmp_path), {"train": ck.ModelState(model2, opt2, sched2),
                                                                "rng": ck.RNGState()})
    assert ck.latest_checkpoint(tmp_path) == path and extra == {"data_position": 48, "kl_coef": 0.05}
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    got = [_train_step(model2, opt2, sched2) for _ in range(2)] + [random.random()]
    assert got == expected
    for p, q in zip(model2.parameters(), expected_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_latest_ignores_tmp_and_keep_last_prunes(tmp_path):
    model, opt, sched = _tiny_training()
    state = {"train": ck.ModelState(model, opt, sched)}
    for step in range(1, 5):
        ck.save_checkpoint(tmp_path, step, state, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    # An interrupted save of step 6: never returned, and cleared by the next committed save.
    ck.begin_save(tmp_path, 6)
    (ck.temporary_dir(tmp_path, 6) / "junk").write_text("half written")
    (tmp_path / "step_5.tmp").mkdir()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_4"
    ck.save_checkpoint(tmp_path, 10, state, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_4"]
    assert ck.checkpoint_step(ck.latest_checkpoint(tmp_path)) == 10
    with pytest.raises(ValueError, match="step_12"):
        ck.checkpoint_step(tmp_path / "step_4.tmp")
    assert ck.latest_checkpoint(tmp_path / "missing") is None


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt, sched = _tiny_training()
    state = {"train": ck.ModelState(model, opt, sched)}
    ck.save_checkpoint(tmp_path, 2, state, extra={"v": 1})
    _train_step(model, opt, sched)
    ck.save_checkpoint(tmp_path, 2, state, extra={"v": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["step_2"]
    assert ck.read_extra(tmp_path / "step_2") == {"v": 2}
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_checkpoint(tmp_path / "step_7", state)


# ---------------------------------------------------------------- FSDP2 on 2 ranks

PRELUDE = """
import os, random, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2ForCausalLM
from hflow import checkpoint as ck
from hflow.default_model import build_config

torch.set_num_threads(1)
dist.init_process_group("gloo")
RANK = dist.get_rank()
MESH = init_device_mesh("cpu", (dist.get_world_size(),))
ROOT = sys.argv[1]

def build(seed):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config("tiny"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=MESH)
    fully_shard(model, mesh=MESH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched

def train_step(model, opt, sched):
    x = torch.randint(3, 500, (4, 12))     # same RNG stream on both ranks: same batch, like DP
    loss = model(x, labels=x).loss
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    return loss.item()

def snapshot(model, opt):
    params = [p.full_tensor().clone() for p in model.parameters()]
    moments = [opt.state[p][k].full_tensor().clone() for p in model.parameters()
               for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    return params, moments, steps

def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, list):
            assert_same(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0)

def state(model, opt, sched):
    return {"actor": ck.ModelState(model, opt, sched), "rng": ck.RNGState()}
"""

SAVE_PERTURB_LOAD = PRELUDE + """
model, opt, sched = build(0)
for _ in range(2):
    train_step(model, opt, sched)
torch.manual_seed(100 + RANK)                # ranks' streams differ: each must get its own back
ck.save_checkpoint(ROOT, 2, state(model, opt, sched), extra={"data_position": 8})
saved = snapshot(model, opt)
draw = torch.rand(3)
continued = [train_step(model, opt, sched) for _ in range(2)]
after = snapshot(model, opt)

torch.manual_seed(7); random.seed(7)       # perturb: RNG, parameters, optimizer state
extra = ck.load_checkpoint(ck.latest_checkpoint(ROOT), state(model, opt, sched))
assert extra == {"data_position": 8}, extra
assert_same(snapshot(model, opt), saved)
assert torch.equal(torch.rand(3), draw)

fresh, fresh_opt, fresh_sched = build(seed=1)   # a new process: other weights, no Adam state yet
ck.load_checkpoint(ck.latest_checkpoint(ROOT), state(fresh, fresh_opt, fresh_sched))
assert_same(snapshot(fresh, fresh_opt), saved)
assert fresh_sched.last_epoch == 2
torch.rand(3)
resumed = [train_step(fresh, fresh_opt, fresh_sched) for _ in range(2)]
assert resumed == continued, (resumed, continued)
assert_same(snapshot(fresh, fresh_opt), after)
print(f"rank {RANK} ok")
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_fsdp2_save_perturb_load_on_2_ranks(tmp_path):
    run = torchrun(SAVE_PERTURB_LOAD, 2, args=[tmp_path / "ckpt"], tmp_path=tmp_path).check()
    assert run.output.count(" ok") == 2, run.output


CRASH_THEN_RESUME = PRELUDE + """
model, opt, sched = build(0)
phase = sys.argv[2]
if phase == "crash":
    train_step(model, opt, sched)
    ck.save_checkpoint(ROOT, 1, state(model, opt, sched), extra={"step": 1})
    snap = snapshot(model, opt)            # collective: every rank gathers
    if RANK == 0:
        torch.save(snap, os.path.join(ROOT, "snapshot_1.pt"))
    train_step(model, opt, sched)
    real_rename = os.rename
    def die_before_commit(src, dst):       # rank 0 dies with every shard of step 2 written
        if str(src).endswith("step_2.tmp"):
            print("rank 0 crashing mid-save", flush=True)
            os._exit(17)
        real_rename(src, dst)
    os.rename = die_before_commit
    ck.save_checkpoint(ROOT, 2, state(model, opt, sched), extra={"step": 2})
    raise SystemExit("unreachable: the save should have crashed")
else:
    latest = ck.latest_checkpoint(ROOT)
    assert latest.name == "step_1", latest
    extra = ck.load_checkpoint(latest, state(model, opt, sched))
    assert extra == {"step": 1}, extra
    assert_same(snapshot(model, opt), torch.load(os.path.join(ROOT, "snapshot_1.pt")))
    ck.save_checkpoint(ROOT, 2, state(model, opt, sched), extra={"step": 2})
    print(f"rank {RANK} resumed ok")
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_crash_mid_save_leaves_the_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "ckpt"
    crashed = torchrun(CRASH_THEN_RESUME, 2, args=[root, "crash"], tmp_path=tmp_path)
    assert not crashed.timed_out and crashed.returncode != 0, crashed.output
    assert "crashing mid-save" in crashed.output and "unreachable" not in crashed.output
    assert (root / "step_2.tmp" / "state" / ".metadata").exists()    # shards written, not committed
    assert ck.latest_checkpoint(root) == root / "step_1"

    resumed = torchrun(CRASH_THEN_RESUME, 2, args=[root, "resume"], tmp_path=tmp_path).check()
    assert resumed.output.count("resumed ok") == 2, resumed.output
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_1", "step_2"]


EXPORT = PRELUDE + """
from transformers import AutoModelForCausalLM, AutoTokenizer
from hflow.default_model import build_tokenizer

model, opt, sched = build(0)
for _ in range(2):
    train_step(model, opt, sched)
x = torch.randint(3, 500, (3, 10))
with torch.no_grad():
    logits = model(x).logits                  # the trained, still-sharded model
out = ck.export_hf(model, os.path.join(ROOT, "hf"), tokenizer=build_tokenizer())
if RANK == 0:
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.architectures == ["Qwen2ForCausalLM"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, logits)
    assert AutoTokenizer.from_pretrained(out).encode("12+35=") == build_tokenizer().encode("12+35=")
params = {n: p.full_tensor() for n, p in model.named_parameters()}   # collective: all ranks
if RANK == 0:   # every exported parameter equals the gathered training parameter exactly
    exported = dict(loaded.named_parameters())
    for name, value in params.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    print("export ok")
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    run = torchrun(EXPORT, 2, args=[tmp_path], tmp_path=tmp_path).check()
    assert "export ok" in run.output, run.output
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja"])
