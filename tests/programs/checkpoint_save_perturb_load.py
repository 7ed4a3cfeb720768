"""FSDP2 save, perturb, load, train on bit for bit; run by test_checkpoint.py::test_fsdp2_save_perturb_load_on_2_ranks."""
import random

import torch
import torch.distributed as dist

# importing checkpoint_common joins the gloo process group
from checkpoint_common import (RANK, ROOT, assert_same, build, resume_on_ranks, save_on_ranks, snapshot, state,
                               train_step)

model, opt, sched = build(0)
for _ in range(2):
    train_step(model, opt, sched)
torch.manual_seed(100 + RANK)                # ranks' streams differ: each must get its own back
save_on_ranks(ROOT, 2, state(model, opt, sched), {"data_position": 8})
saved = snapshot(model, opt)
draw = torch.rand(3)
continued = [train_step(model, opt, sched) for _ in range(2)]
after = snapshot(model, opt)

torch.manual_seed(7); random.seed(7)       # perturb: RNG, parameters, optimizer state
extra = resume_on_ranks(ROOT, state(model, opt, sched))
assert extra["data_position"] == 8 and extra["step"] == 2, extra
assert_same(snapshot(model, opt), saved)
assert torch.equal(torch.rand(3), draw)

fresh, fresh_opt, fresh_sched = build(seed=1)   # a new process: other weights, no Adam state yet
resume_on_ranks(ROOT, state(fresh, fresh_opt, fresh_sched))
assert_same(snapshot(fresh, fresh_opt), saved)
assert fresh_sched.last_epoch == 2
torch.rand(3)
resumed = [train_step(fresh, fresh_opt, fresh_sched) for _ in range(2)]
assert resumed == continued, (resumed, continued)
assert_same(snapshot(fresh, fresh_opt), after)
print(f"rank {RANK} ok")
dist.destroy_process_group()
