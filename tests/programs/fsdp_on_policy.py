"""On-policy updates with and without old_log_probs; run by test_fsdp.py::test_on_policy_update_skips_the_old_log_probs_pass."""
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow.distributed.byte_counters import CollectiveBytes
from hflow.workers import Actor, ActorConfig, OptimConfig
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out = sys.argv[1], sys.argv[2]

def ppo_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    ratio = torch.exp(logp - mb["old_log_probs"])
    per_token = -torch.min(ratio * mb["advantages"], ratio.clamp(0.8, 1.2) * mb["advantages"])
    return (per_token * mask).sum() / mask.sum(), {"ratio_dev": ((ratio - 1).abs() * mask).sum() / mask.sum(),
                                                   "advantage_max": mb["advantages"][mask.bool()].max()}

cfg = ActorConfig(model_path=path, micro_batch_size=3, optim=OptimConfig(lr=1e-2, grad_clip=0.5))
recomputing, skipping = Actor(mesh, cfg), Actor(mesh, cfg)
saved = {"recompute": [], "skip": []}
for step in range(3):
    batch = random_rollouts(4, 2, 101, seed=20 + step)
    del batch["old_log_probs"]
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    saved.setdefault("advantage_max", []).append(batch["advantages"][batch["response_mask"].bool()].max().item())
    old = recomputing.log_probs(local)["old_log_probs"]
    saved["recompute"].append(recomputing.update({**local, "old_log_probs": old}, ppo_loss))
    with CollectiveBytes() as moved:
        saved["skip"].append(skipping.update(local, ppo_loss))
    saved.setdefault("received", moved.received)
for name, actor in (("recompute", recomputing), ("skip", skipping)):
    saved[name + "_weights"] = {n: p.full_tensor() for n, p in actor.model.named_parameters()}
off_policy = Actor(mesh, ActorConfig(model_path=path, epochs=2))
try:
    off_policy.update(local, ppo_loss)
except ValueError as e:
    saved["error"] = str(e)
if rank == 0:
    torch.save(saved, out)
dist.destroy_process_group()
