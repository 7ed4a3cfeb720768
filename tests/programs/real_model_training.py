"""The FSDP2 Actor on real weights (SmolLM2-135M-Instruct in fp32, every parameter sharded over the
2 ranks): log-probs of a chat batch, one update, and the hybrid engine after it; run by
test_real_model_training.py, which checks what is saved against transformers.

    torchrun --nproc-per-node 2 real_model_training.py MODEL_DIR OUT_DIR

Writes (rank 0) OUT_DIR/results.pt: log_probs (the actor's [B, R] log-probs of
test_real_model_training.chat_rollouts before the update), metrics (the update's), rollout (the
engine's samples after the update: the layout's tensors, rollout_log_probs, and the actor's
recomputed log-probs `recomputed`); OUT_DIR/grads.pt: {name: the full gradient the optimizer
stepped with}; and OUT_DIR/exported: the updated policy as a Hugging Face directory (actor.export_hf). Checks here
itself that the engine holds exactly the updated training weights (its tied head included) and
that its sampled-token log-probs equal the actor's recomputed ones within TOLERANCE_LOG_PROBS."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hflow import algos
from hflow.batch import Batch
from hflow.distributed.parallel import release_freed_memory
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig, RolloutConfig
from test_real_model_training import (LR, MICRO_BATCH_SIZE, N, TEMPERATURE, TOLERANCE_LOG_PROBS,
                                      chat_rollouts)

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out = sys.argv[1], sys.argv[2]


def policy_loss(logp, mb, entropy=None):
    """The recipes' PPO loss, token-mean. On-policy (the batch has no old_log_probs): the ratio is
    exactly 1, so the gradient is -A * grad log-prob summed over the tokens / their count."""
    return algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], agg="token-mean")


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


cfg = ActorConfig(model_path=path, micro_batch_size=MICRO_BATCH_SIZE,
                  fsdp=FSDPConfig(param_dtype="float32", shard_size=world),
                  optim=OptimConfig(lr=LR, grad_clip=0.0))
actor = Actor(mesh, cfg)
params = dict(actor.model.named_parameters())
# one tied parameter (lm_head is embed_tokens), and every parameter really sharded over the ranks
assert "lm_head.weight" not in params and actor.model.lm_head.weight is actor.model.model.embed_tokens.weight
assert all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in params.values()), \
    [n for n, p in params.items() if not isinstance(p, DTensor) or p.to_local().numel() == p.numel()]

batch, prompt_ids = chat_rollouts(path)
local = {k: v.chunk(world)[rank] for k, v in batch.items()}   # 3 prompts x N samples a rank
saved = {}

# 1. log-probs
saved["log_probs"] = gather_rows(actor.log_probs(local, temperature=1.0)["old_log_probs"])

# 2. one update; the gradient the optimizer steps with (every rank takes part in the gathers)
names = {p: n for n, p in params.items()}
grads = {}


def keep_gradient(optimizer, args, kwargs):
    for p, name in names.items():
        full = p.grad.full_tensor()
        if rank == 0:
            grads[name] = full


actor.optimizer.register_step_pre_hook(keep_gradient)
saved["metrics"] = actor.update(Batch(local, meta={"n": N, "temperature": 1.0}), policy_loss)
if rank == 0:   # to disk at once: a full fp32 copy of the model less held through the export and the rollout
    torch.save(grads, os.path.join(out, "grads.pt"))
grads.clear()
release_freed_memory(actor.device)   # what the update freed, before the export and the engine allocate (as end_rollout does)
print(f"rank {rank}: {saved['metrics']}", flush=True)
actor.export_hf(os.path.join(out, "exported"))
release_freed_memory(actor.device)

# 3. the engine after the update: tensor-parallel size 1 (SmolLM2's 9 query / 3 KV heads do not
# split over 2 ranks), so each rank's engine gets every weight all-gathered from the training shards
per_rank = len(prompt_ids) // world
prompts = Batch({"prompt_ids": prompt_ids[rank * per_rank:(rank + 1) * per_rank]})
rollout = RolloutConfig(n=N, max_tokens=12, temperature=TEMPERATURE, seed=1, progress=False,
                        kv_cache_bytes=32 << 20, max_model_len=256)
actor.begin_rollout(rollout)
targets = actor.hybrid_engine.llm.model.weight_targets()
worst = max((targets[name][0] - p.full_tensor()).abs().max().item() for name, p in params.items())
head, embedding = targets["lm_head.weight"][0], targets["model.embed_tokens.weight"][0]
assert head.data_ptr() == embedding.data_ptr(), "the engine's head is not its embedding"
sampled = actor.sample(prompts, rollout)
actor.end_rollout()
recomputed = actor.log_probs(sampled, TEMPERATURE)["old_log_probs"]
mask = sampled["response_mask"].bool()
diff = (recomputed - sampled["rollout_log_probs"])[mask].abs().max().item()
print(f"rank {rank}: engine vs training weights {worst:.2e}; engine vs trainer log-probs {diff:.2e} "
      f"over {int(mask.sum())} sampled tokens", flush=True)
assert worst == 0.0, worst
assert diff <= TOLERANCE_LOG_PROBS, diff
# every rank's rows padded to the same widths (rollout_batch), so they concatenate
keys = ("input_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs")
saved["rollout"] = {k: gather_rows(sampled[k]) for k in keys} | {"recomputed": gather_rows(recomputed)}

if rank == 0:
    torch.save(saved, os.path.join(out, "results.pt"))
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception") after every check passed: leave at once once everyone is done (as fsdp_loss_agg.py)
dist.barrier()
sys.stdout.flush()
os._exit(0)
