"""A few GRPO steps on a random model of a real shape, with each phase's time and the device's
memory peaks: the RL part of scripts/gpu_check.sh.

The model is a random Qwen2 or Qwen3 of the chosen shape (0.5b: Qwen2.5-0.5B's, 494M parameters;
qwen3-0.6b: Qwen3-0.6B's, 596M, the shape of scripts/bench_rl.py --model qwen3-0.6b on CPU; both
with vocab 151,936), its EOS logit lifted so that responses end with probability ~--eos-prob per
token (the trick of scripts/bench_generate.py); prompts are random token ids; the reward is
the share of even token ids in the response (cheap, and it varies within a group, so every
advantage is not 0). Per step: actor.generate (the hybrid engine), the reference's log-probs
(a frozen model: bf16 storage on a GPU), the KL to it, GRPO advantages, actor.update (one
optimizer step, on-policy: the update's own log-probs are the old ones, weighted against the
engine's by truncated importance sampling, with the gap between the two printed; --lora-rank:
LoRA adapters instead of full fine-tuning). After each phase every
rank reports its peak memory in it (torch.cuda.max_memory_allocated; on CPU the process's
peak RSS, which only grows) and the memory reserved by the caching allocator.

    torchrun --nproc-per-node 1 scripts/gpu_grpo_steps.py                     # GPU: 0.5b, bf16
    torchrun --nproc-per-node 1 scripts/gpu_grpo_steps.py --shape qwen3-0.6b
    HFLOW_DEVICE=cpu torchrun --nproc-per-node 1 scripts/gpu_grpo_steps.py --shape tiny --steps 2
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import tempfile
import time

import torch

import hflow
from hflow import algos
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.lora import LoRAConfig
from hflow.workers import Actor, ActorConfig, OptimConfig, Reference, RolloutConfig
from hflow.workers.fsdp import FSDPConfig

SHAPES = {"0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, inter=4864, vocab=151936),
          # Qwen3: 16/8 heads of 128, wider than hidden / heads
          "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, inter=3072, vocab=151936, head_dim=128),
          "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab=512)}


def memory(device: torch.device) -> dict[str, float]:
    """This rank's peak memory since the last call, and what is reserved now, in GiB."""
    gib = 1 << 30
    if device.type == "cuda":
        out = {"peak": torch.cuda.max_memory_allocated(device) / gib, "reserved": torch.cuda.memory_reserved(device) / gib}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), "reserved": float("nan")}


class ProbedActor(Actor):
    @dispatch("all")
    def memory(self) -> dict[str, float]:
        return memory(next(iter(self.model.parameters())).device)


class ProbedReference(Reference):
    @dispatch("all")
    def memory(self) -> dict[str, float]:
        return memory(next(iter(self.model.parameters())).device)


def make_model_dir(shape: str, eos_prob: float, path: str) -> None:
    """A random Qwen2 (Qwen3 where the shape has a head_dim) of `shape`, saved in bf16 (the
    workers load it into their own dtype)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    size = SHAPES[shape]
    vocab = size["vocab"]
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=size["hidden"], intermediate_size=size["inter"],
                  num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                  num_key_value_heads=size["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=True,
                  eos_token_id=vocab - 1, bos_token_id=vocab - 1, pad_token_id=0)
    model = (Qwen3ForCausalLM(Qwen3Config(**common, head_dim=size["head_dim"])) if "head_dim" in size
             else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    emb = model.model.embed_tokens.weight.data
    emb[:, 0] = 1.0   # after the final norm h[0] is large and nearly constant: the EOS row's +delta lifts its logit
    with torch.no_grad():
        h0 = model.model(torch.randint(1, vocab - 1, (4, 32))).last_hidden_state[..., 0].mean().item()
    emb[vocab - 1, 0] = 1.0 + math.log(eos_prob * (vocab - 1) / (1 - eos_prob)) / h0
    model.to(torch.bfloat16).save_pretrained(path)


def grpo_loss(logp, mb, entropy=None):
    """On-policy (the update's own log-probs are the old ones), truncated importance weights
    against the engine's: the bf16 engine/trainer gap is measured (mismatch/*) and corrected."""
    weights, corrected = algos.RolloutCorrection("tis")(mb)
    loss, metrics = algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                                      is_weights=weights)
    return loss, metrics | corrected


def main(cluster, args):
    print(f"{cluster.world_size} rank(s) on {cluster.device_type}; model {args.shape}, {args.dtype}; "
          f"{args.prompts} prompts x n={args.samples}, <= {args.max_tokens} new tokens", flush=True)
    cfg = ActorConfig(model_path=args.model_dir, optim=OptimConfig(lr=1e-6), micro_batch_size=args.micro_batch,
                      fsdp=FSDPConfig(param_dtype=args.dtype), lora=LoRAConfig(rank=args.lora_rank))
    t = time.perf_counter()
    actor = cluster.spawn(ProbedActor, cfg)
    ref = cluster.spawn(ProbedReference, dataclasses.replace(cfg, lora=LoRAConfig()))
    print(f"actor and reference built in {time.perf_counter() - t:.1f} s; memory per rank "
          f"(peak GiB): {[round(m['peak'], 2) for m in actor.memory()]}", flush=True)
    vocab = SHAPES[args.shape]["vocab"]
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps):
        prompts = Batch({"prompt_ids": [torch.randint(1, vocab - 1, (int(k),), generator=g).tolist()
                                        for k in torch.randint(args.prompt_len // 2, args.prompt_len + 1,
                                                               (args.prompts,), generator=g)]})
        times, peaks = {}, {}

        def phase(name, fn):
            start = time.perf_counter()
            out = fn()
            times[name] = time.perf_counter() - start
            peaks[name] = max(m["peak"] for m in actor.memory() + ref.memory())
            return out

        rollout = RolloutConfig(n=args.samples, max_tokens=args.max_tokens, temperature=1.0, seed=step, progress=False,
                                gpu_memory_fraction=args.gpu_memory_fraction)
        batch = phase("generate", lambda: actor.generate(prompts, rollout))
        mask = batch["response_mask"]
        batch = batch | phase("ref_log_probs", lambda: ref.log_probs(batch, 1.0))
        scores = ((batch["responses"] % 2 == 0) * mask).sum(1) / mask.sum(1).clamp(min=1)
        kl = algos.kl_penalty(batch["rollout_log_probs"], batch["ref_log_probs"], "k1") * mask
        rewards = algos.scores_to_token_rewards(scores, mask) - 0.001 * kl
        batch["advantages"] = algos.grpo_advantages(rewards.sum(1), torch.arange(len(batch)) // args.samples, mask)
        metrics = phase("update", lambda: actor.update(batch, grpo_loss)[0])
        tokens = int(mask.sum())
        step_s = sum(times.values())
        rows.append((times, peaks, tokens))
        print(f"step {step}: " + ", ".join(f"{k} {v:.2f} s (peak {peaks[k]:.2f} GiB)" for k, v in times.items())
              + f"; {tokens} response tokens ({tokens / step_s:.0f} tok/s), mean length {tokens / len(batch):.0f}, "
              f"grad norm {metrics['actor/grad_norm']:.3g}; engine vs trainer |d log p| mean "
              f"{metrics['actor/mismatch/abs_log_ratio_mean']:.2e} max {metrics['actor/mismatch/abs_log_ratio_max']:.2e}, "
              f"IS weight {metrics['actor/mismatch/is_weight_mean']:.4f} "
              f"({metrics['actor/mismatch/capped_fraction']:.1%} capped)", flush=True)
    if len(rows) > 1:  # the first step pays for start-up (allocator, kernels)
        rows = rows[1:]
    mean = {k: sum(r[0][k] for r in rows) / len(rows) for k in rows[0][0]}
    peak = {k: max(r[1][k] for r in rows) for k in rows[0][1]}
    print("summary (steps after the first): " + ", ".join(f"{k} {mean[k]:.2f} s" for k in mean)
          + f"; step {sum(mean.values()):.2f} s; peak memory per rank " + ", ".join(f"{k} {peak[k]:.2f} GiB" for k in peak)
          + f"; {sum(r[2] for r in rows) / sum(sum(r[0].values()) for r in rows):.0f} response tok/s", flush=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--dtype", default="auto", help="FSDP compute dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    ap.add_argument("--prompt-len", type=int, default=256, help="longest prompt (the shortest is half)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--eos-prob", type=float, default=0.004, help="per-token EOS probability (mean length ~1/p)")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on the actor (0: full fine-tuning)")
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward on a rank")
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    ap.add_argument("--model-dir", default="", help="where to save the random model (default: a temporary directory)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if not args.model_dir:
        args.model_dir = os.path.join(tempfile.gettempdir(), f"hflow_gpu_check_{args.shape}")
    # rank 0 writes the model before it joins; the other ranks wait for it in launch's rendezvous
    if int(os.environ.get("RANK", 0)) == 0 and not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        make_model_dir(args.shape, args.eos_prob, args.model_dir)
    hflow.launch(main, args)
