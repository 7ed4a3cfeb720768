"""One on-policy update per loss aggregation and micro-batching (1, 2, all sequences of a rank), its gradient saved to argv[2]; run by test_fsdp.py::test_every_micro_batching_and_rank_count_gives_the_aggregation_asked_for."""
import dataclasses, functools, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow import algos
from hflow.workers import Actor, ActorConfig, OptimConfig
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out = sys.argv[1], sys.argv[2]


def loss_fn(logp, mb, entropy=None, *, agg):
    return algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], agg=agg)


batch = random_rollouts(4, 2, 101, seed=30)
del batch["old_log_probs"]   # on-policy: ratio 1, so every response token has a gradient
local = {k: v.chunk(world)[rank] for k, v in batch.items()}
# lr 0 and no clipping: every update sees the same weights, and the optimizer sees the raw gradient
actor = Actor(mesh, ActorConfig(model_path=path, optim=OptimConfig(lr=0.0, grad_clip=0.0)))
names = {p: n for n, p in actor.model.named_parameters()}
grads = []
actor.optimizer.register_step_pre_hook(
    lambda optimizer, args, kwargs: grads.append({names[p]: p.grad.full_tensor() for p in names if p.grad is not None}))
saved = {}
for agg in algos.AGG_MODES:
    for micro in (1, 2, len(local["input_ids"])):
        actor.cfg = dataclasses.replace(actor.cfg, micro_batch_size=micro)
        actor.update(local, functools.partial(loss_fn, agg=agg), loss_agg=agg)
        saved[agg, "all" if micro == len(local["input_ids"]) else micro] = grads.pop()
if rank == 0:
    torch.save(saved, out)
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception") after every check passed: leave at once once everyone is done (as reshard_generation_shards.py)
dist.barrier()
sys.stdout.flush()
os._exit(0)
