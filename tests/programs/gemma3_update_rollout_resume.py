"""The FSDP2 Actor on a tiny Gemma 3 over the ranks: one update, then the hybrid engine holds exactly
the updated weights (Gemma's four norms a layer included) and samples with the trainer's log-probs
on prompts longer than the sliding window; then a checkpoint resumes bit for bit. Run by
test_gemma3.py::test_an_update_reaches_the_engine_and_a_checkpoint_resumes.

    torchrun --nproc-per-node 2 gemma3_update_rollout_resume.py MODEL_DIR CHECKPOINT_DIR"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig, RolloutConfig
from test_fsdp import random_rollouts

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, checkpoint = sys.argv[1], sys.argv[2]
cfg = ActorConfig(model_path=path, micro_batch_size=3, fsdp=FSDPConfig(param_dtype="float32", shard_size=world),
                  optim=OptimConfig(lr=1e-2))
TEMPERATURE = 0.8


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return (-mb["advantages"] * logp * mask).sum() / mask.sum(), {}


def local_batch(seed):
    batch = random_rollouts(4, 2, 101, seed=seed)
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def full_weights(actor):
    return {n: p.full_tensor() for n, p in actor.model.named_parameters()}


actor = Actor(mesh, cfg)
before = full_weights(actor)
actor.update(local_batch(1), pg_loss)
after = full_weights(actor)
moved = max((after[n] - before[n]).abs().max().item() for n in after)

# 1. the engine holds the updated weights, and samples with the trainer's log-probs
rollout = RolloutConfig(n=2, max_tokens=12, temperature=TEMPERATURE, seed=1, progress=False,
                        kv_cache_bytes=8 << 20, max_model_len=64)
actor.begin_rollout(rollout)
targets = actor.hybrid_engine.llm.model.weight_targets()
assert set(after) <= set(targets), sorted(set(after) - set(targets))
worst = max((targets[n][0] - w).abs().max().item() for n, w in after.items())
prompts = Batch({"prompt_ids": [[5 + rank, 9, 11, 40, 7, 3, 66, 12, 9], list(range(3 + rank, 20))]})
sampled = actor.sample(prompts, rollout)
actor.end_rollout()
recomputed = actor.log_probs(sampled, TEMPERATURE)["old_log_probs"]
mask = sampled["response_mask"].bool()
diff = (recomputed - sampled["rollout_log_probs"])[mask].abs().max().item()
print(f"rank {rank}: moved {moved:.2e}; engine vs training weights {worst:.2e}; engine vs trainer log-probs "
      f"{diff:.2e} over {int(mask.sum())} tokens", flush=True)
assert moved > 1e-3 and worst == 0.0 and diff < 1e-4, (moved, worst, diff)

# 2. save, update once more; a fresh actor loads the checkpoint and makes the same update
actor.save(checkpoint)
actor.update(local_batch(2), pg_loss)
expected = full_weights(actor)
fresh = Actor(mesh, cfg)
fresh.load(checkpoint)
fresh.update(local_batch(2), pg_loss)
got = full_weights(fresh)
assert all(torch.equal(got[n], expected[n]) for n in expected), [n for n in expected if not torch.equal(got[n], expected[n])]
print(f"rank {rank} resumed ok", flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
