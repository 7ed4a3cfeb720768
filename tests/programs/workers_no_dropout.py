"""Dropout off in every worker model, and a step with a non-finite gradient norm skipped without moving the schedule; run by test_workers.py::test_dropout_is_off_and_a_non_finite_step_is_skipped."""
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow.workers import Actor, ActorConfig, Critic, CriticConfig, OptimConfig, Reference
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
actor_path, critic_path, out = sys.argv[1:4]


def logp_loss(logp, mb, entropy=None):
    """The training pass's log-probs, summed, and their largest distance to the old ones."""
    mask = mb["response_mask"]
    return -(logp * mask).sum() / mask.sum(), {"logp_sum": (logp * mask).sum().item(),
                                               "max_log_ratio": ((logp - mb["old_log_probs"]).abs() * mask).max().item()}


def nan_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return (logp * mask).sum() * float("nan"), {}


def weights(worker):
    return {n: p.full_tensor().clone() for n, p in worker.model.named_parameters()}


batch = random_rollouts(4, 2, 101, seed=40)
local = {k: v.chunk(world)[rank] for k, v in batch.items()}
saved = {}

# the training pass computes the policy that sampled (lr 0: both updates see the same weights)
actor = Actor(mesh, ActorConfig(model_path=actor_path, micro_batch_size=3, optim=OptimConfig(lr=0.0)))
old = actor.log_probs(local)["old_log_probs"]
saved["updates"] = [actor.update({**local, "old_log_probs": old}, logp_loss) for _ in range(2)]
critic = Critic(mesh, CriticConfig(model_path=critic_path))
ref = Reference(mesh, ActorConfig(model_path=actor_path))
saved["dropout"] = {
    role: [(name, m.p) for name, m in worker.model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p != 0]
    + [(key, v) for key, v in vars(worker.model.config).items() if "dropout" in key and v != 0]
    for role, worker in (("actor", actor), ("ref", ref), ("critic", critic))}

# a NaN loss: the step is skipped, the weights and the schedule stay where they were
actor = Actor(mesh, ActorConfig(model_path=actor_path, optim=OptimConfig(lr=1e-2, warmup_steps=4)))
before = weights(actor)
saved["nan"] = actor.update(local, nan_loss)
saved["unchanged"] = all(torch.equal(w, before[n]) for n, w in weights(actor).items())
saved["next"] = actor.update(local, logp_loss)
saved["changed"] = any(not torch.equal(w, before[n]) for n, w in weights(actor).items())
if rank == 0:
    torch.save(saved, out)
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception") after every check passed: leave at once once everyone is done (as reshard_generation_shards.py)
dist.barrier()
sys.stdout.flush()
os._exit(0)
