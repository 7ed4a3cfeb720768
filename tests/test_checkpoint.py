"""Checkpoints through the controller's save_run / resume_run and the workers' save_sharded /
load_sharded: atomic commit, keep-last, resume that continues training bit for bit (1 process
and FSDP2 on 2 ranks), a crash mid-save, and Hugging Face export."""
import os
import random

import pytest
import torch

from dist import PROGRAMS, torchrun
from hflow import checkpoint as ck
from programs.checkpoint_fake_group import FakeGroup


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
    path = ck.save_run(tmp_path, 3, {"actor": FakeGroup(model, opt, sched)}, {"data_position": 48, "kl_coef": 0.05})
    expected = [_train_step(model, opt, sched) for _ in range(2)] + [random.random()]
    expected_params = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(123)                         # a fresh process would start elsewhere
    random.seed(123)
    model2, opt2, sched2 = _tiny_training(seed=1)
    extra = ck.resume_run(tmp_path, {"actor": FakeGroup(model2, opt2, sched2)})
    assert ck.latest_checkpoint(tmp_path) == path
    assert extra == {"data_position": 48, "kl_coef": 0.05, "step": 3, "changed_settings": {}}
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    got = [_train_step(model2, opt2, sched2) for _ in range(2)] + [random.random()]
    assert got == expected
    for p, q in zip(model2.parameters(), expected_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_latest_ignores_tmp_and_keep_last_prunes(tmp_path):
    model, opt, sched = _tiny_training()
    groups = {"actor": FakeGroup(model, opt, sched)}
    for step in range(1, 5):
        ck.save_run(tmp_path, step, groups, {}, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    # An interrupted save of step 6: never returned, and cleared by the next committed save.
    ck.begin_save(tmp_path, 6)
    (ck.temporary_dir(tmp_path, 6) / "junk").write_text("half written")
    (tmp_path / "step_5.tmp").mkdir()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step_4"
    ck.save_run(tmp_path, 10, groups, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_4"]
    assert ck.checkpoint_step(ck.latest_checkpoint(tmp_path)) == 10
    with pytest.raises(ValueError, match="step_12"):
        ck.checkpoint_step(tmp_path / "step_4.tmp")
    assert ck.latest_checkpoint(tmp_path / "missing") is None
    assert ck.list_checkpoints(tmp_path / "missing") == []


def test_a_failed_later_save_is_cleared_when_the_next_save_begins_and_on_resume(tmp_path):
    """Resumed from step 2 after step 4's save failed: step_4.tmp must not hold its disk space
    until some later commit (the save of step 3 would run out of room first)."""
    model, opt, sched = _tiny_training()
    ck.save_run(tmp_path, 2, {"actor": FakeGroup(model, opt, sched)}, {})
    (tmp_path / "step_4.tmp" / "actor").mkdir(parents=True)
    (tmp_path / "step_4.tmp" / "actor" / "__0_0.distcp").write_bytes(b"partial")
    assert ck.begin_save(tmp_path, 3) == tmp_path / "step_3.tmp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3.tmp"]
    (tmp_path / "step_4.tmp").mkdir()
    assert ck.resume_run(tmp_path, {}) == {"step": 2, "changed_settings": {}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt, sched = _tiny_training()
    group = FakeGroup(model, opt, sched)
    ck.save_run(tmp_path, 2, {"actor": group}, {"v": 1})
    _train_step(model, opt, sched)
    ck.save_run(tmp_path, 2, {"actor": group}, {"v": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["step_2"]
    assert ck.read_extra(tmp_path / "step_2")["v"] == 2
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_sharded(tmp_path / "step_7" / "actor", group.state)


# ---------------------------------------------------------------- FSDP2 on 2 ranks

SAVE_PERTURB_LOAD = os.path.join(PROGRAMS, "checkpoint_save_perturb_load.py")


@pytest.mark.dist
def test_fsdp2_save_perturb_load_on_2_ranks(tmp_path):
    run = torchrun(SAVE_PERTURB_LOAD, 2, args=[tmp_path / "ckpt"], tmp_path=tmp_path).check()
    assert run.output.count(" ok") == 2, run.output


ACROSS_LAYOUTS = os.path.join(PROGRAMS, "checkpoint_across_layouts.py")


@pytest.mark.dist
def test_checkpoint_loads_across_sharding_layouts(tmp_path):
    """The CPU default replicates small models (HSDP, shard groups of 1) and GPUs shard them:
    a checkpoint of either layout loads, bit for bit, into the other."""
    run = torchrun(ACROSS_LAYOUTS, 2, args=[tmp_path / "ckpt"], tmp_path=tmp_path).check()
    assert run.output.count(" ok") == 4, run.output


CRASH_THEN_RESUME = os.path.join(PROGRAMS, "checkpoint_crash_then_resume.py")


@pytest.mark.dist
def test_crash_mid_save_leaves_the_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "ckpt"
    crashed = torchrun(CRASH_THEN_RESUME, 2, args=[root, "crash"], tmp_path=tmp_path)
    assert not crashed.timed_out and crashed.returncode != 0, crashed.output
    assert "crashing mid-save" in crashed.output and "unreachable" not in crashed.output
    assert (root / "step_2.tmp" / "actor" / ".metadata").exists()    # shards written, not committed
    assert ck.latest_checkpoint(root) == root / "step_1"

    resumed = torchrun(CRASH_THEN_RESUME, 2, args=[root, "resume"], tmp_path=tmp_path).check()
    assert resumed.output.count("resumed ok") == 2, resumed.output
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_1", "step_2"]


EXPORT = os.path.join(PROGRAMS, "checkpoint_export.py")


@pytest.mark.dist
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    run = torchrun(EXPORT, 2, args=[tmp_path], tmp_path=tmp_path).check()
    assert "export ok" in run.output, run.output
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja"])
