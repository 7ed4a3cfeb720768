"""What an update leaves behind goes back before the engine wakes; run by
test_workers.py::test_begin_rollout_gives_the_updates_memory_back."""
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow.workers import Actor, ActorConfig, RolloutConfig
from hflow.workers.hybrid_engine import release_training_memory
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
actor = Actor(mesh, ActorConfig(model_path=sys.argv[1]))


def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mean_log_prob(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(logp * mask).sum() / mask.sum(), {}


def update():
    batch = random_rollouts(8, 2, 4096, seed=3)
    actor.update({k: v.chunk(world)[rank] for k, v in batch.items()}, mean_log_prob)
    return sum(b.nbytes for b in actor.model.reused_buffers.kept) / 2**20


kept = update()
before = resident_mib()
release_training_memory(actor.model, torch.device("cpu"))
print(f"rank {rank}: kept {kept:.0f} MiB, released {before - resident_mib():.0f} MiB", flush=True)
update()
actor.begin_rollout(RolloutConfig(n=1, max_tokens=4, progress=False, kv_cache_bytes=8 << 20))
print(f"rank {rank}: kept while awake {len(actor.model.reused_buffers.kept)}", flush=True)
actor.end_rollout()
dist.barrier()
dist.destroy_process_group()
