"""Three PPO updates, metrics and weights saved to argv[2]; run by test_fsdp.py::test_one_rank_and_two_ranks_train_the_same."""
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3])   # shard_size 1 on 2 ranks: replicated (HSDP)

def ppo_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    ratio = torch.exp(logp - mb["old_log_probs"])
    per_token = -torch.min(ratio * mb["advantages"], ratio.clamp(0.8, 1.2) * mb["advantages"])
    clipped = ((ratio - 1).abs() > 0.2).float()
    if agg == "token-mean":
        mean = lambda x: (x * mask).sum() / mask.sum()
    else:  # seq-mean-token-mean
        mean = lambda x: ((x * mask).sum(-1) / mask.sum(-1)).mean()
    return mean(per_token), {"clipfrac": mean(clipped)}

saved = {}
for agg in ("token-mean", "seq-mean-token-mean"):
    # different micro-batching on each layout: by count on 1 rank, by token budget on 2
    # (and activation checkpointing on 2 ranks: it recomputes, it must not change anything;
    # nor must keeping the gathered parameters from the forward to the backward)
    cfg = ActorConfig(model_path=path, mini_batch_size=2, epochs=2, micro_batch_size=3,
                      max_tokens_per_micro_batch=0 if world == 1 else 24,
                      fsdp=FSDPConfig(activation_checkpointing=world == 2, shard_size=shard_size,
                                      reshard_after_forward=world == 1 or agg == "token-mean"),
                      optim=OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=20,
                                        grad_clip=0.5))
    actor = Actor(mesh, cfg)
    metrics = []
    for step in range(3):
        batch = random_rollouts(4, 2, 101, seed=10 + step)
        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        actor.log_probs(local)   # a forward with no backward must leave the weights sharded
        assert all(isinstance(p, DTensor) for p in actor.model.parameters())
        metrics.append(actor.update(local, ppo_loss, loss_agg=agg))
    saved[agg] = {"metrics": metrics,
                        "weights": {n: p.full_tensor() for n, p in actor.model.named_parameters()}}
if rank == 0:
    torch.save(saved, out)
# both ranks leave together: once in a full suite run rank 1 aborted in gloo's teardown
# ("terminate called without an active exception") while rank 0 was still saving
dist.barrier()
dist.destroy_process_group()
