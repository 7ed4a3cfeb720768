"""The FSDP2 Actor on a tiny Qwen3-MoE (tests/test_qwen3_moe.py's tiny_moe, saved with per-expert
tensors) in fp32 over the world's ranks: log-probs, one on-policy update, then the hybrid
engine on the updated weights and routing replay of its samples; run by test_moe_training.py on
1 and on 2 ranks, which compares what is saved against transformers and between the two runs.

    torchrun --nproc-per-node N moe_training.py MODEL_DIR OUT_DIR

Writes (rank 0) OUT_DIR/results.pt: log_probs (before the update), metrics (the update's),
engine_gap (max |engine - trainer| log-prob over the sampled tokens, replay off and on),
replay_metrics (an update on the samples with --actor.moe.routing-replay); and
OUT_DIR/exported (the policy after the first update). Checks here that the engine holds exactly
the trainer's updated weights."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hflow import algos
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig, RolloutConfig
from test_moe_training import LR, rollouts

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out = sys.argv[1], sys.argv[2]


def policy_loss(logp, mb, entropy=None):
    return algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], agg="token-mean")


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


cfg = ActorConfig(model_path=path, micro_batch_size=2, fsdp=FSDPConfig(param_dtype="float32", shard_size=world),
                  optim=OptimConfig(lr=LR, grad_clip=0.0))
actor = Actor(mesh, cfg)
params = dict(actor.model.named_parameters())
if world > 1:   # the experts sharded like every other weight
    experts = params["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(experts, DTensor) and experts.to_local().shape[0] == experts.shape[0] // world

batch = rollouts()
local = {k: v.chunk(world)[rank] for k, v in batch.items()}
saved = {"log_probs": gather_rows(actor.log_probs(local, temperature=1.0)["old_log_probs"])}
saved["metrics"] = actor.update(Batch(local, meta={"n": 2, "temperature": 1.0}), policy_loss)
actor.export_hf(os.path.join(out, "exported"))

# the engine on the updated weights: every weight as the trainer holds it
prompts = Batch({"prompt_ids": [[5, 9, 11, 3], [7] * 9, list(range(20, 33))][rank::world] if world > 1
                 else [[5, 9, 11, 3], [7] * 9, list(range(20, 33))]})
rollout = RolloutConfig(n=3, max_tokens=10, temperature=1.0, seed=1, progress=False, kv_cache_bytes=8 << 20,
                        max_model_len=128, block_size=4)
actor.begin_rollout(rollout)
targets = actor.hybrid_engine.llm.model.weight_targets()
worst = max((targets[name][0] - p.full_tensor().view(targets[name][0].shape) if isinstance(p, DTensor)
             else targets[name][0] - p.view(targets[name][0].shape)).abs().max().item() for name, p in params.items())
assert worst == 0.0, worst
sampled = actor.sample(prompts, rollout)
actor.end_rollout()
assert sampled["routed_experts"].shape[2:] == (2, 2), sampled["routed_experts"].shape
mask = sampled["response_mask"].bool()
gaps = {}
for replay in (False, True):
    actor.cfg.moe.routing_replay = replay
    recomputed = actor.log_probs(sampled, 1.0)["old_log_probs"]
    gaps[replay] = (recomputed - sampled["rollout_log_probs"])[mask].abs().max().item()
saved["engine_gap"] = gaps

# other experts than the engine's (each shifted by one): replayed, they change the log-probs;
# compared only, they change nothing and every known token x layer disagrees
routes = sampled["routed_experts"]
wrong = Batch({**sampled.tensors, **sampled.objects, "routed_experts": torch.where(routes >= 0, (routes + 1) % 8, routes)},
              meta=sampled.meta)
logp = {}
for replay, batch_ in ((False, sampled), (False, wrong), (True, wrong)):
    actor.cfg.moe.routing_replay = replay
    actor.routing.totals = [0, 0]
    logp[(replay, batch_ is wrong)] = actor.log_probs(batch_, 1.0)["old_log_probs"]
    differ, compared = actor.routing.totals
saved["wrong_routes"] = {"replayed_moves": (logp[(True, True)] - logp[(False, False)])[mask].abs().max().item(),
                         "compared_moves": (logp[(False, True)] - logp[(False, False)]).abs().max().item(),
                         "disagreement": differ / compared,
                         "compared": compared, "known": int((routes >= 0).all(-1).sum())}
print(f"rank {rank}: engine vs trainer log-probs, replay off {gaps[False]:.2e}, on {gaps[True]:.2e}", flush=True)

sampled["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(rank)) * mask
sampled.meta["n"] = 3
saved["replay_metrics"] = actor.update(sampled, policy_loss)
if rank == 0:
    torch.save(saved, os.path.join(out, "results.pt"))
dist.barrier()
sys.stdout.flush()
os._exit(0)
