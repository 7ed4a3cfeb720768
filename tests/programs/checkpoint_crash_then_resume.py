"""Rank 0 dies mid-save, then the ranks resume; run by test_checkpoint.py::test_crash_mid_save_leaves_the_previous_checkpoint_usable."""
import os
import sys

import torch
import torch.distributed as dist

# importing checkpoint_common joins the gloo process group
from checkpoint_common import (RANK, ROOT, assert_same, build, resume_on_ranks, save_on_ranks, snapshot, state,
                               train_step)
from hflow import checkpoint as ck

model, opt, sched = build(0)
phase = sys.argv[2]
if phase == "crash":
    train_step(model, opt, sched)
    save_on_ranks(ROOT, 1, state(model, opt, sched), {"position": 1})
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
    save_on_ranks(ROOT, 2, state(model, opt, sched), {"position": 2})
    raise SystemExit("unreachable: the save should have crashed")
else:
    latest = ck.latest_checkpoint(ROOT)
    assert latest.name == "step_1", latest
    extra = resume_on_ranks(ROOT, state(model, opt, sched))
    assert extra["step"] == 1 and extra["position"] == 1, extra
    assert_same(snapshot(model, opt), torch.load(os.path.join(ROOT, "snapshot_1.pt")))
    save_on_ranks(ROOT, 2, state(model, opt, sched), {"position": 2})
    print(f"rank {RANK} resumed ok")
dist.barrier()   # both ranks done with the save's collectives before the group goes
dist.destroy_process_group()
