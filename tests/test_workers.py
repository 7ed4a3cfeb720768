"""Workers under the controller: the hybrid engine (resharded weights, sample log-probs),
critic and reward model against transformers, checkpoints."""
import os

import pytest
from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir


HYBRID = os.path.join(PROGRAMS, "workers_hybrid.py")


@pytest.mark.dist
@pytest.mark.parametrize("world,tps", [(2, "1,2"), (4, "2")])
def test_engine_follows_training_weights(tmp_path, world, tps):
    """After an update the engine holds exactly the training weights (tp_g 1 and 2 on 2 ranks,
    2 on 4) and the log-probs it returns for its samples equal actor.log_probs."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(HYBRID, nproc=world, args=[path, tps], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert run.output.count("log-prob diff") == len(tps.split(","))


ROUNDS = os.path.join(PROGRAMS, "workers_rollout_rounds.py")


@pytest.mark.dist
def test_sample_rounds_share_one_weight_load(tmp_path):
    """begin_rollout, two sample rounds, end_rollout: the batches of two generate calls with the
    same seeds, on one load of the weights (tp_g 1 and 2 on 2 ranks); update and load are
    refused while the rollout is open."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(ROUNDS, nproc=2, args=[path, "1,2"], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert run.output.count("equal two generate calls") == 2 and "refusals ok" in run.output, run.output


MODELS = os.path.join(PROGRAMS, "workers_models.py")


def classifier_dir(path, kind, seed=1, dropout=0.0):
    """A random value model (token classifier) or reward model (sequence classifier)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         classifier_dropout=dropout, attention_dropout=dropout, pad_token_id=0, eos_token_id=1)
    Model = Qwen2ForTokenClassification if kind == "value" else Qwen2ForSequenceClassification
    Model(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.dist
def test_critic_reward_and_checkpoints(tmp_path):
    actor = tiny_model_dir(tmp_path / "actor", shard=False)
    critic = classifier_dir(tmp_path / "critic", "value")
    reward = classifier_dir(tmp_path / "reward", "reward", seed=2)
    run = torchrun(MODELS, nproc=2, args=[actor, critic, reward, tmp_path], tmp_path=tmp_path,
                   timeout=300, env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert "checkpoint ok" in run.output


NO_DROPOUT = os.path.join(PROGRAMS, "workers_no_dropout.py")


@pytest.mark.dist
def test_dropout_is_off_and_a_non_finite_step_is_skipped(tmp_path):
    """Models whose configs ask for dropout (attention 0.5, classifier 0.3) train without it: two
    training passes give the same log-probs, equal to the eval pass's (the first on-policy ratio
    is 1). A NaN loss skips its optimizer step, counts it, and leaves the learning-rate warm-up
    where it was."""
    import json
    actor = tiny_model_dir(tmp_path / "actor", shard=False)
    config = json.loads((tmp_path / "actor" / "config.json").read_text())
    (tmp_path / "actor" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    critic = classifier_dir(tmp_path / "critic", "value", dropout=0.3)
    torchrun(NO_DROPOUT, nproc=2, args=[actor, critic, tmp_path / "out.pt"], tmp_path=tmp_path,
             timeout=300, env=TESTS_ENV).check()
    saved = __import__("torch").load(tmp_path / "out.pt")
    first, second = saved["updates"]
    assert first["actor/logp_sum"] == second["actor/logp_sum"]
    assert first["actor/max_log_ratio"] < 1e-5
    assert saved["dropout"] == {"actor": [], "ref": [], "critic": []}
    nan, after = saved["nan"], saved["next"]
    assert nan["actor/skipped_steps"] == 1.0 and after["actor/skipped_steps"] == 0.0
    assert saved["unchanged"] and saved["changed"]
    # warm-up over 4 steps: the first step taken runs at lr/4, however many were skipped before it
    assert nan["actor/lr"] == after["actor/lr"] == 1e-2 / 4


ENGINE_MEMORY = r'''
import os, sys
import torch, torch.distributed as dist
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig
import hflow.workers.hybrid_engine as hybrid_engine

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

dist.init_process_group("gloo")
actor = Actor(dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), ActorConfig(model_path=sys.argv[1]))
rollout = RolloutConfig(n=4, max_tokens=24, temperature=1.0, progress=False, kv_cache_bytes=32 << 20)
prompts = Batch({"prompt_ids": [[3, 4, 5, 6, 7]] * 8})

def one_rollout():
    before = resident_mib()
    actor.begin_rollout(rollout)
    actor.sample(prompts, rollout)
    awake = resident_mib()
    actor.end_rollout()
    return awake - before, resident_mib() - before

one_rollout()   # the heap's first growth
for label in ("released", "kept"):
    if label == "kept":
        hybrid_engine.release_freed_memory = lambda device: False
    awake, asleep = one_rollout()
    print(f"{label}: awake +{awake:.0f} MiB, asleep +{asleep:.0f} MiB", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.dist
@pytest.mark.skipif(getattr(__import__("ctypes").CDLL(None), "malloc_trim", None) is None,
                    reason="glibc's malloc_trim only")
def test_end_rollout_gives_the_engines_memory_back(tmp_path):
    """What the engine held (weights, their packed copies, the KV cache: ~120 MiB here) leaves
    the process's resident memory at end_rollout, as the update will want it. Without the
    release glibc keeps much of it in its heap (the control half of the run)."""
    import re
    path = tiny_model_dir(tmp_path / "model", vocab=4096, layers=8, hidden=512, shard=False)
    run = torchrun(ENGINE_MEMORY, nproc=1, args=[path], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    figures = {label: (float(awake), float(asleep)) for label, awake, asleep in
               re.findall(r"(\w+): awake \+(-?\d+) MiB, asleep \+(-?\d+) MiB", run.output)}
    (awake, released), (awake_kept, kept) = figures["released"], figures["kept"]
    assert awake > 60 and awake_kept > 60, run.output
    # the control: glibc keeps 35-90 % of it resident (how much depends on where the heap's top
    # ended up), the release all but a few MiB
    assert kept > 0.25 * awake_kept, run.output
    assert released < 0.15 * awake, run.output


UPDATE_MEMORY = os.path.join(PROGRAMS, "update_memory_release.py")


@pytest.mark.dist
@pytest.mark.skipif(getattr(__import__("ctypes").CDLL(None), "malloc_trim", None) is None,
                    reason="glibc's malloc_trim only")
def test_begin_rollout_gives_the_updates_memory_back(tmp_path):
    """FSDP's communication buffers, kept between an update's layers for reuse on CPU, and the
    heap pages the update freed leave the process before the engine allocates its weights and
    cache: without it a 135M model's generation peaked 0.6 GiB higher (docs/real-model.md)."""
    import re
    path = tiny_model_dir(tmp_path / "model", vocab=4096, layers=4, hidden=256, tie=True, shard=False)
    run = torchrun(UPDATE_MEMORY, nproc=2, args=[path], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    figures = re.findall(r"kept (\d+) MiB, released (-?\d+) MiB", run.output)
    assert len(figures) == 2, run.output
    for kept, released in figures:
        assert int(kept) >= 4 and int(released) >= 0.8 * int(kept), run.output
    assert run.output.count("kept while awake 0") == 2, run.output
