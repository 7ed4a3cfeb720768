"""Checkpoints on a file system that fills up; run by test_checkpoint_disk_full.py on a small tmpfs
(argv[1], mounted in a private mount namespace). Every check prints a line; the last is "disk full ok"."""
import sys
from pathlib import Path

import torch

from checkpoint_fake_group import FakeGroup, params, trained_linear
from hflow import checkpoint as ck

torch.set_num_threads(1)
disk = Path(sys.argv[1])
root = disk / "checkpoints"


def expect_disk_full(what, step, call):
    try:
        call()
    except ck.CheckpointError as e:
        text = str(e)
        print(f"--- {what}:\n{text}")
        tmp = ck.temporary_dir(root, step)
        for needed in ("no space left on device", f"step {step}", str(tmp), "free there now"):
            assert needed in text, (needed, text)
        assert "unexpected pos" not in text, text
        assert not tmp.exists(), f"{tmp} left behind"
        return text
    raise AssertionError(f"{what}: the save did not fail")


small_model, small_opt = trained_linear(16, 16)
small = FakeGroup(small_model, small_opt)
ck.save_run(root, 1, {"actor": small}, {"data": {"position": 3}}, keep_last=2)
saved = params(small_model)

# 1. a worker's shard does not fit: torch's short write, reported through a RemoteError's text
big = FakeGroup(torch.nn.Linear(1024, 1024))          # 4 MiB of weights
text = expect_disk_full("shard", 2, lambda: ck.save_run(root, 2, {"actor": big}, {"data": {}}))
assert "step_1, the last complete checkpoint, takes" in text, text

# 2. the controller's own file does not fit: ENOSPC (errno) from write_extra
expect_disk_full("extra", 2, lambda: ck.save_run(root, 2, {"actor": small}, {"blob": list(range(400_000))}))

# 3. a partial save that a killed process left behind takes space; resume clears it and works
stale = ck.temporary_dir(root, 7)
stale.mkdir()
try:
    (stale / "junk").write_bytes(b"x" * (4 << 20))
except OSError:
    pass                                              # it filled the disk: that is the point
model2, opt2 = trained_linear(16, 16, seed=5)
extra = ck.resume_run(root, {"actor": FakeGroup(model2, opt2)})
assert extra["step"] == 1 and extra["data"] == {"position": 3}, extra
assert not stale.exists()
for p, q in zip(params(model2), saved):
    assert torch.equal(p, q)
ck.save_run(root, 2, {"actor": FakeGroup(model2, opt2)}, {"data": {"position": 4}}, keep_last=2)
assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"], sorted(root.iterdir())
assert ck.resume_run(root, {"actor": FakeGroup(*trained_linear(16, 16, seed=9))})["step"] == 2
print("disk full ok")
