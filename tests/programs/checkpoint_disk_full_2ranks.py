"""Two ranks save into a file system that fills up, only rank 1's shard being too big; run by
test_checkpoint_disk_full.py under torchrun on a small tmpfs (argv[1]), rank 0 as the controller
and both ranks as one worker group. Both ranks must fail with an error that says so (no hang),
the partial directory must go, and the previous checkpoint load."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint_fake_group import resume_on_ranks, save_on_ranks
from hflow import checkpoint as ck

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
root = Path(sys.argv[1]) / "checkpoints"

mine = torch.full((256,), float(rank))
save_on_ranks(root, 1, {f"w{rank}": mine}, {"position": 1})
big = torch.zeros(512 * 1024) if rank == 1 else torch.zeros(16)    # 2 MiB on rank 1 only
try:
    save_on_ranks(root, 2, {f"w{rank}": big}, {"position": 2})
    raise SystemExit(f"rank {rank}: the save did not fail")
except ck.CheckpointError as e:
    assert "no space left on device" in str(e) and "step 2" in str(e), str(e)
dist.barrier()
assert not ck.temporary_dir(root, 2).exists() and ck.latest_checkpoint(root) == root / "step_1"
back = {f"w{rank}": torch.zeros(256)}
extra = resume_on_ranks(root, back)
assert extra["step"] == 1 and extra["position"] == 1, extra
assert torch.equal(back[f"w{rank}"], mine)
print(f"rank {rank} disk full ok", flush=True)
dist.destroy_process_group()
