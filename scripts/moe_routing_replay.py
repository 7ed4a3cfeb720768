"""Routing replay (R3) on a tiny random Qwen3-MoE in bf16: the engine/trainer log-prob gap and
the importance weights' spread over the sampled tokens, with and without replay.

The hybrid Actor (FSDP2 on 1 CPU rank, bf16 parameters) samples with its engine, then
recomputes the sampled tokens' log-probs with the trainer (actor.log_probs) twice: routing
replay off (the trainer's own top-k) and on (the engine's experts, the trainer's router weights
at them). Printed, for each: mean and max |delta| = |log p_trainer - log p_engine|, std of
exp(delta) (the IS weight the off-policy correction would apply), and the fraction of token x
MoE-layer pairs whose top-k sets differ between engine and trainer.

    python scripts/moe_routing_replay.py                 # 16 experts top-4, router init std 0.02
    python scripts/moe_routing_replay.py --router-std 0.5   # a peaked router: fewer flips

A router initialised as transformers does (std 0.02) is near-uniform, so bf16 rounding flips
many top-k choices: the regime where replay matters. Runs in ~1-2 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, FSDPConfig, RolloutConfig


def tiny_moe_dir(path: str, args) -> str:
    torch.manual_seed(args.seed)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         max_position_embeddings=512, eos_token_id=None, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0, args.router_std)
    model.save_pretrained(path)
    return path


def gap(actor: Actor, sampled: Batch, replay: bool, temperature: float) -> dict[str, float]:
    actor.cfg.moe.routing_replay = replay
    actor.routing.totals = [0, 0]
    logp = actor.log_probs(sampled, temperature)["old_log_probs"]
    mask = sampled["response_mask"].bool()
    delta = (logp - sampled["rollout_log_probs"])[mask].double()
    differ, compared = actor.routing.totals
    return {"mean |dlogp|": delta.abs().mean().item(), "max |dlogp|": delta.abs().max().item(),
            "std exp(d)": delta.exp().std().item(), "routing disagreement": differ / max(compared, 1),
            "tokens": int(mask.sum())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--router-std", type=float, default=0.02)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo")
    torch.set_num_threads(2)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with tempfile.TemporaryDirectory() as tmp:
        actor = Actor(mesh, ActorConfig(model_path=tiny_moe_dir(tmp, args), micro_batch_size=16,
                                        fsdp=FSDPConfig(param_dtype=args.dtype)))
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, 24, (args.prompts,), generator=g)]
        rollout = RolloutConfig(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                progress=False, kv_cache_bytes=64 << 20, max_model_len=512)
        actor.begin_rollout(rollout)
        sampled = actor.sample(Batch({"prompt_ids": prompts}), rollout)
        actor.end_rollout()
        print(f"{args.experts} experts top-{args.top_k}, {args.layers} MoE layers, router std {args.router_std}, "
              f"{args.dtype}; {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens")
        for replay in (False, True):
            row = gap(actor, sampled, replay, args.temperature)
            print(f"replay {'on ' if replay else 'off'}: " + ", ".join(
                f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
