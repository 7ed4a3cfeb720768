"""What resume does with what a crash or damage left: a damaged manifest.json is one more damaged
checkpoint (resume falls back past it); keep_last never removes the checkpoint it just committed."""
import json
import os

import pytest
import torch

from hflow import checkpoint as ck
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
