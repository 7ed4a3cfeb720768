"""What resume does with what a crash or damage left: a damaged manifest.json is one more damaged
checkpoint (resume falls back past it); keep_last never removes the checkpoint it just committed;
a crash between the two renames of a step saved again leaves that step as it was; the directory
entries of a checkpoint are on disk before its rename; a Hugging Face export is whole or absent."""
import json
import os
import shutil

import pytest
import torch

from hflow import checkpoint as ck
from hflow.checkpoint.dirs import output_dir_problems
from programs.checkpoint_crash_points import CRASHED, run_crashing
from programs.checkpoint_fake_group import FakeGroup


def _group(seed=0):
    torch.manual_seed(seed)
    return FakeGroup(torch.nn.Linear(2, 2, bias=False))


def _save(root, step, version=None, keep_last=None):
    ck.save_run(root, step, {"actor": _group(step)}, {"version": version or f"step {step}"}, keep_last)


def _resume(root):
    extra = ck.resume_run(root, {"actor": _group(99)})
    return extra and (extra["step"], extra["version"])


# ---------------------------------------------------------------- a damaged manifest.json

def _manifest_entries(path):
    return json.loads((path / ck.MANIFEST).read_text())["files"]


DAMAGED_MANIFESTS = {
    "zeroed": lambda path: b"\0" * (path / ck.MANIFEST).stat().st_size,
    "a JSON list": lambda path: b"[]",
    "files a list": lambda path: json.dumps({"format": 1, "step": 3, "files": []}).encode(),
    "files null": lambda path: json.dumps({"format": 1, "step": 3, "files": None}).encode(),
    "an entry of the wrong types": lambda path: json.dumps({"format": 1, "step": 3, "files": {
        name: {"size": str(e["size"]), "sha256": 7} for name, e in _manifest_entries(path).items()}}).encode(),
    "no files listed": lambda path: json.dumps({"format": 1, "step": 3, "files": {}}).encode(),
    "a file outside the checkpoint": lambda path: json.dumps({"format": 1, "step": 3, "files": {
        **_manifest_entries(path), "../step_2/extra.json": _manifest_entries(path.parent / "step_2")["extra.json"]}
    }).encode(),
}


@pytest.mark.parametrize("damage", DAMAGED_MANIFESTS)
def test_resume_falls_back_past_a_damaged_manifest(tmp_path, capsys, damage):
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    step_3 = tmp_path / "step_3"
    (step_3 / ck.MANIFEST).write_bytes(DAMAGED_MANIFESTS[damage](step_3))
    assert _resume(tmp_path) == (2, "step 2")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert "step_3 (step 3) is damaged" in line and "resuming from step_2" in line, line


def test_a_damaged_manifest_on_the_only_checkpoint_is_named(tmp_path):
    _save(tmp_path, 3)
    (tmp_path / "step_3" / ck.MANIFEST).write_bytes(b"\0" * 64)
    with pytest.raises(ck.CheckpointError, match=r"every one is damaged\n  step_3: .*manifest\.json is unreadable"):
        _resume(tmp_path)


# ---------------------------------------------------------------- keep_last

def test_keep_last_keeps_the_checkpoint_it_just_committed_below_a_damaged_newer_one(tmp_path):
    """Resumed from step 10 past a damaged step 20, the run saves step 15 with keep_last=1: step 15
    must stay (step 20, not older, is left for the run to replace when it gets there)."""
    _save(tmp_path, 10, keep_last=2)
    _save(tmp_path, 20, keep_last=2)
    os.truncate(tmp_path / "step_20" / "actor" / "__0_0.distcp", 10)
    assert _resume(tmp_path) == (10, "step 10")
    _save(tmp_path, 15, keep_last=1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_15", "step_20"]
    assert _resume(tmp_path) == (15, "step 15")
    _save(tmp_path, 20, "step 20 again", keep_last=1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_20"]
    assert _resume(tmp_path) == (20, "step 20 again")


# ---------------------------------------------------------------- saving a step again

def _ops_of(fn, root):
    """The disk operations of `fn()`, paths relative to `root` (run to the end in a child)."""
    code, ops = run_crashing(fn, crash_at=None, relative_to=root)
    assert code == 0
    return ops


def test_a_crash_between_the_renames_of_a_step_saved_again_keeps_that_step(tmp_path):
    """step_2 is moved aside (step_2.old) and step_2.tmp is about to take its place when the
    process dies. The rename of step_2.tmp is the commit: resume must find step 2 as it was
    (it deleted the new save and ignored step_2.old, resuming from step 1)."""
    root, dry = tmp_path / "ckpt", tmp_path / "dry"
    _save(root, 1)
    _save(root, 2, "first")
    shutil.copytree(root, dry)
    ops = _ops_of(lambda: _save(dry, 2, "second"), dry)
    between = ops.index(["rename", "step_2.tmp", "step_2"]) + 1
    code, done = run_crashing(lambda: _save(root, 2, "second"), crash_at=between, relative_to=root)
    assert code == CRASHED and done[-2] == ["rename", "step_2", "step_2.old"]
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2.old", "step_2.tmp"]
    assert _resume(root) == (2, "first")
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    _save(root, 2, "second")
    assert _resume(root) == (2, "second")


def test_a_checkpoints_directories_are_synced_after_its_last_rename_inside_and_before_its_commit(tmp_path):
    """A rename is durable once its directory is fsynced: step_N.tmp and each group's directory
    must be, after manifest.json (and .metadata, extra.json) are renamed into them and before
    step_N.tmp becomes step_N, or a power cut could publish a checkpoint without its manifest."""
    _save(tmp_path, 1)
    ops = _ops_of(lambda: _save(tmp_path, 2), tmp_path)
    manifest = ops.index(["replace", "step_2.tmp/manifest.json.part", "step_2.tmp/manifest.json"])
    commit = ops.index(["rename", "step_2.tmp", "step_2"])
    synced = [op[1] for op in ops[manifest:commit] if op[0] == "fsync"]
    assert "step_2.tmp" in synced and "step_2.tmp/actor" in synced, ops[manifest:commit + 1]


# ---------------------------------------------------------------- the Hugging Face export

class _Trainer:
    def __init__(self, output_dir):
        self.output_dir, self.resume, self.overwrite = output_dir, True, False


def _tiny_model():
    from transformers import Qwen2ForCausalLM
    from hflow.default.model import build_config
    torch.manual_seed(0)
    return Qwen2ForCausalLM(build_config("tiny", vocab_size=64))


def test_an_export_killed_midway_leaves_no_actor_hf_and_the_run_can_resume(tmp_path):
    """The run dies while writing output_dir/actor_hf (no checkpoint was kept): what is there must
    not look like a finished run, and the next export replaces whatever was left."""
    model, out = _tiny_model(), tmp_path / "actor_hf"
    ops = _ops_of(lambda: ck.export_hf(model, tmp_path / "dry"), tmp_path)
    midway = next(i for i, op in enumerate(ops) if op[0] == "write" and op[1].endswith("config.json")) + 2
    code, _ = run_crashing(lambda: ck.export_hf(model, out), crash_at=midway, relative_to=tmp_path)
    assert code == CRASHED
    assert not out.exists()
    assert output_dir_problems(_Trainer(tmp_path)) == []
    ck.export_hf(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor_hf", "dry"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "dry").iterdir())
    ck.export_hf(model, out)                       # a later export replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor_hf", "dry"]
