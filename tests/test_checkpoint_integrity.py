"""Checkpoint integrity: a manifest (size + sha256 of every file) written before the commit, checked
on resume; a damaged checkpoint (changed bytes, truncated or missing file) is named in one line and
the previous one is used; when none verifies the error names the files; checkpoints without a
manifest load with a warning."""
import hashlib
import json
import os
import random

import pytest
import torch

from hflow import checkpoint as ck
from programs.checkpoint_fake_group import FakeGroup, params, trained_linear

SHARD = "actor/__0_0.distcp"


def _two_checkpoints(root):
    """step_1 and step_2 of a 128x128 linear layer with AdamW (a shard of ~200 KiB); returns
    each step's parameters."""
    model, opt = trained_linear(128, 128)
    group = FakeGroup(model, opt)
    saved = {}
    for step in (1, 2):
        ck.save_run(root, step, {"actor": group}, {"data": {"position": step}})
        saved[step] = params(model)
        model(torch.randn(2, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
    return saved


def _resume(root):
    model, opt = trained_linear(128, 128, seed=7)
    extra = ck.resume_run(root, {"actor": FakeGroup(model, opt)})
    return extra, params(model)


def _damage_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "damaged" in line]


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    _two_checkpoints(tmp_path)
    path = tmp_path / "step_2"
    manifest = json.loads((path / ck.MANIFEST).read_text())
    assert manifest["step"] == 2
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != ck.MANIFEST)
    assert sorted(manifest["files"]) == on_disk and "extra.json" in on_disk and SHARD in on_disk
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert ck.verify(path) == []


def test_changed_bytes_in_a_shard_fall_back_to_the_previous_checkpoint(tmp_path, capsys):
    saved = _two_checkpoints(tmp_path)
    shard = tmp_path / "step_2" / SHARD
    size = shard.stat().st_size
    assert size > 2 * 65536
    with open(shard, "r+b") as f:                 # 64 KiB of other bytes, the size unchanged
        f.seek(size // 2 - 32768)
        f.write(random.Random(0).randbytes(65536))
    assert shard.stat().st_size == size

    extra, got = _resume(tmp_path)
    assert extra == {"data": {"position": 1}, "step": 1, "changed_settings": {}}
    assert all(torch.equal(p, q) for p, q in zip(got, saved[1]))
    lines = _damage_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "step_2 (step 2) is damaged" in lines[0] and SHARD in lines[0] and "changed bytes" in lines[0]
    assert "resuming from step_1 (step 1) instead" in lines[0]


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_missing_file_falls_back_and_is_named(tmp_path, capsys, damage):
    saved = _two_checkpoints(tmp_path)
    shard = tmp_path / "step_2" / SHARD
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 3)
    else:
        (tmp_path / "step_2" / "extra.json").unlink()
    extra, got = _resume(tmp_path)
    assert extra["step"] == 1 and all(torch.equal(p, q) for p, q in zip(got, saved[1]))
    (line,) = _damage_lines(capsys.readouterr().err)
    assert ("actor/__0_0.distcp is truncated" if damage == "truncate" else "extra.json is missing") in line, line


def test_when_no_checkpoint_verifies_the_error_names_every_damaged_file(tmp_path):
    _two_checkpoints(tmp_path)
    os.truncate(tmp_path / "step_2" / SHARD, 100)
    with open(tmp_path / "step_1" / "actor" / ".metadata", "r+b") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ck.CheckpointError) as info:
        _resume(tmp_path)
    text = str(info.value)
    assert "no checkpoint under" in text and "every one is damaged" in text
    assert "step_2: actor/__0_0.distcp is truncated (100 of" in text
    assert "step_1: actor/.metadata has changed bytes" in text


def test_a_damaged_only_checkpoint_is_named_with_its_step_and_nothing_loads(tmp_path):
    model, opt = trained_linear(128, 128)
    ck.save_run(tmp_path, 3, {"actor": FakeGroup(model, opt)}, {"k": 1})
    assert sorted(json.loads((tmp_path / "step_3" / ck.MANIFEST).read_text())["files"]) == [
        "actor/.metadata", "actor/__0_0.distcp", "extra.json"]
    os.truncate(tmp_path / "step_3" / SHARD, 1000)
    other, other_opt = trained_linear(128, 128, seed=1)
    before = params(other)
    with pytest.raises(ck.CheckpointError, match=rf"step_3: {SHARD} is truncated \(1000 of \d+ bytes\)"):
        ck.resume_run(tmp_path, {"actor": FakeGroup(other, other_opt)})
    assert all(torch.equal(p, q) for p, q in zip(params(other), before))


def test_a_checkpoint_without_manifest_loads_with_one_warning_line(tmp_path, capsys):
    saved = _two_checkpoints(tmp_path)
    (tmp_path / "step_2" / ck.MANIFEST).unlink()
    ck.set_rng_state(ck.read_extra(tmp_path / "step_2")["rng"])
    expected = _draws()
    torch.manual_seed(99)
    random.seed(99)
    extra, got = _resume(tmp_path)
    assert _draws() == expected                    # the controller's RNG state, from extra.json
    assert extra == {"data": {"position": 2}, "step": 2, "changed_settings": {}}
    assert all(torch.equal(p, q) for p, q in zip(got, saved[2]))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "no manifest.json" in warnings[0], err


def test_a_checkpoint_without_extra_json_is_refused_naming_the_file(tmp_path):
    """An older hflow's checkpoint (no manifest, extra.pt) is not read: its controller state
    would be lost without a word."""
    _two_checkpoints(tmp_path)
    path = tmp_path / "step_2"
    (path / ck.MANIFEST).unlink()
    (path / "extra.json").rename(path / "extra.pt")
    with pytest.raises(ck.CheckpointError, match=r"step 2 .*extra.json is missing .*extra.pt"):
        ck.read_extra(path)


def _draws():
    import numpy as np
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_without_a_manifest_a_truncated_shard_is_still_named_with_its_step(tmp_path, capsys):
    saved = _two_checkpoints(tmp_path)
    for step in (1, 2):
        (tmp_path / f"step_{step}" / ck.MANIFEST).unlink()
    shard = tmp_path / "step_2" / SHARD
    os.truncate(shard, 5000)
    model, opt = trained_linear(128, 128, seed=3)
    with pytest.raises(ck.CheckpointError, match=rf"step 2 .*{shard} is truncated \(5000 bytes"):
        ck.load_sharded(tmp_path / "step_2" / "actor", FakeGroup(model, opt).state)
    extra, got = _resume(tmp_path)                      # and resume falls back past it
    assert extra["step"] == 1 and all(torch.equal(p, q) for p, q in zip(got, saved[1]))
    assert "step_2 (step 2) is damaged" in capsys.readouterr().err
