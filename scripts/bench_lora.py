"""LoRA against full fine-tuning at Qwen3-0.6B's shape: time of an update and of the weight
hand-off to the engine, and memory per process, side by side in one run.

The model is a random Qwen3-0.6B (hidden 1024, 28 layers, 16/8 heads of 128, MLP 3072, vocab
151,936, tied embeddings) saved once in bf16 under ~/.cache/hflow/bench/. Each mode runs on
--ranks ranks (torchrun, 2/ranks threads each) the real Actor: --steps updates of one fixed
batch (--batch sequences of --prompt-len + --response-len tokens, one optimizer step each, the
policy-gradient loss), each followed by a rollout hand-off (begin_rollout: the weights, merged
for LoRA, resharded into the engine; end_rollout). Compute in --dtype with fp32 master weights
(LoRA: the base frozen in --dtype, fp32 adapters). Reported: the median over the steps after the
first, and each rank's peak resident memory (ru_maxrss) at the end.

    python scripts/bench_lora.py                     # 2 ranks, bf16, LoRA rank 16 on every projection
    python scripts/bench_lora.py --layers 4 --steps 2   # a quick check (~2 min)

Floor of the update: 6 N T FLOPs for full fine-tuning (forward, and backward for activations
and weights), 4 N T for LoRA (no weight gradients of the base; the adapters' own are ~1 %), N
the body's parameters plus the head's for the response tokens only, over the bf16 matmul peak
measured here (torch.mm, the MLP's shape, 2 threads).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hflow.runtime.dispatch import dispatch   # noqa: E402
from hflow.workers import Actor        # noqa: E402
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)


def model_dir(layers: int) -> Path:
    """The random Qwen3-0.6B-shaped model (with `layers` decoder layers), built once."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path.home() / ".cache" / "hflow" / "bench" / f"qwen3-0.6b-shape-L{layers}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers}, eos_token_id=151645, pad_token_id=151643,
                         bos_token_id=151643)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path.with_suffix(".tmp"), safe_serialization=True)
    os.replace(path.with_suffix(".tmp"), path)
    return path


def bf16_peak(threads: int = 2) -> float:
    """FLOP/s of a [2048, 1024] x [1024, 3072] bf16 torch.mm, best of 10."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 1024, dtype=torch.bfloat16), torch.randn(1024, 3072, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(12):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 * 1024 * 3072 / best


def worker(args) -> None:
    """One mode on the torchrun ranks (hflow.launch): the Actor's updates and hand-offs."""
    import torch

    import hflow
    from hflow.layout import sequence_tensors
    from hflow.lora import LoRAConfig
    from hflow.workers import ActorConfig, OptimConfig, RolloutConfig
    from hflow.workers.fsdp import FSDPConfig

    def main(cluster, _):
        lora = LoRAConfig(rank=args.lora_rank if args.mode == "lora" else 0)
        cfg = ActorConfig(model_path=str(args.model), optim=OptimConfig(lr=1e-5), lora=lora,
                          micro_batch_size=args.batch, fsdp=FSDPConfig(param_dtype=args.dtype))
        actor = cluster.spawn(MeasuredActor, cfg)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1000, 100000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        responses = [torch.randint(1000, 100000, (args.response_len,), generator=g).tolist() for _ in range(args.batch)]
        batch = sequence_tensors(prompts, responses, pad_id=151643)
        batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
        rollout = RolloutConfig(n=1, max_tokens=1)
        times = {"update_s": [], "handoff_s": []}
        for _ in range(args.steps):
            start = time.perf_counter()
            actor.update(batch, pg_loss)
            times["update_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            actor.begin_rollout(rollout)
            actor.end_rollout()
            times["handoff_s"].append(time.perf_counter() - start)
        result = {"mode": args.mode, "times": times, "peak_rss_gib": actor.peak_rss_gib(),
                  "trained_parameters": actor.trained_parameters()[0]}
        Path(args.out).write_text(json.dumps(result))

    hflow.launch(main)


class MeasuredActor(Actor):
    """The Actor, and what this script reads off each rank."""

    @dispatch("all")
    def peak_rss_gib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    @dispatch("all")
    def trained_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)   # a DTensor's: global


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return worker(args)
    model = model_dir(args.layers)
    load = os.getloadavg()[0]
    results = {}
    for mode in ("full", "lora"):
        out = Path(f"/tmp/bench_lora_{mode}.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // args.ranks))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), __file__,
               "--mode", mode, "--model", str(model), "--out", str(out), "--steps", str(args.steps),
               "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
               "--response-len", str(args.response_len), "--dtype", args.dtype, "--lora-rank", str(args.lora_rank)]
        out.unlink(missing_ok=True)
        done = subprocess.run(cmd, env=env, cwd=REPO)
        if done.returncode:   # e.g. SIGKILL by the kernel's OOM killer: the other mode still runs
            print(f"bench_lora: {mode} failed (exit {done.returncode}; -9 or 1 after a SIGKILL is most "
                  f"often the OOM killer: see dmesg)", flush=True)
            continue
        results[mode] = json.loads(out.read_text())
    peak = bf16_peak()
    config = json.loads((model / "config.json").read_text())
    h, inter, layers, vocab = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], \
        config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    body = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    tokens = args.batch * (args.prompt_len + args.response_len)
    forward = 2 * body * tokens + 2 * h * vocab * args.batch * args.response_len
    print(f"\nQwen3-0.6B shape, {layers} layers, {args.ranks} ranks, {args.dtype} compute; batch {args.batch} x "
          f"({args.prompt_len} + {args.response_len}) tokens; LoRA rank {args.lora_rank}; load {load:.1f} at start; "
          f"bf16 mm peak {peak / 1e12:.2f} TFLOP/s (2 threads)")
    print("| | trained parameters | update s | floor s | hand-off s | peak RSS per rank GiB |\n|---|---|---|---|---|---|")
    for mode, r in results.items():
        floor = (3 if mode == "full" else 2) * forward / peak
        update = statistics.median(r["times"]["update_s"][1:] or r["times"]["update_s"])
        handoff = statistics.median(r["times"]["handoff_s"][1:] or r["times"]["handoff_s"])
        rss = " / ".join(f"{x:.1f}" for x in r["peak_rss_gib"])
        print(f"| {mode} | {r['trained_parameters'] / 1e6:.1f}M | {update:.1f} | {floor:.1f} | {handoff:.1f} | {rss} |")
    if len(results) < 2:
        return
    f, lo = results["full"], results["lora"]
    print(f"LoRA / full: update {statistics.median(lo['times']['update_s'][1:] or lo['times']['update_s']) / statistics.median(f['times']['update_s'][1:] or f['times']['update_s']):.2f}x time, "
          f"peak memory {max(lo['peak_rss_gib']) / max(f['peak_rss_gib']):.2f}x")


if __name__ == "__main__":
    main()
