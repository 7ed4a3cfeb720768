"""Where one actor update's time goes: one rank's share of scripts/bench_rl.py's vary workload.

One process, world size 1 (FSDP2 on a 1-rank mesh: no collectives to wait on), --threads
threads (1), the bench's 25M Qwen2 in fp32 (or --model qwen3-0.6b: Qwen3-0.6B's shape, in bf16
with fp32 master weights where the CPU has bf16 instructions, as hflow's auto picks) and a
GRPO-shaped batch: --sequences rows (default 32, one rank's share of 16 prompts x 4), prompts of
8-64 tokens, responses of 1-96 tokens drawn as the vary workload's lengths fall (EOS with
probability 0.015 per token). Prints the process CPU time of each update (the first is a
warm-up), the split into forward / backward / optimizer, the memory each update first touched
(minor page faults: on CPU, buffers freed and allocated again cost their pages each time), the
process's peak resident set, and, with --profile,
one update under torch.profiler by kind of op, with the matmul floor (forward + backward FLOPs /
this script's measured matmul peak on the update's shapes, in the compute dtype).

    python scripts/profile_update.py                 # CPU per update and its phases
    python scripts/profile_update.py --profile       # + one update under torch.profiler
    python scripts/profile_update.py --model qwen3-0.6b --threads 2 --sequences 32 --profile
    python scripts/profile_update.py --model-path DIR --sequences 64 --n 8 --max-response 48
                                                     # a real model: one rank's share of 16 x 8
    ... --max-tokens-per-micro-batch 1024 --activation-checkpointing   # what memory costs
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl import SIZES, make_model   # noqa: E402  (a sibling script)

from hflow import algos   # noqa: E402
from hflow.workers import Actor, ActorConfig, OptimConfig   # noqa: E402
from hflow.workers.fsdp import FSDPConfig, auto_param_dtype   # noqa: E402
from hflow.layout import sequence_tensors   # noqa: E402
from hflow.workers.micro_batches import packed_tokens   # noqa: E402

KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"), "attention (SDPA)": ("scaled_dot_product",),
         "gather / scatter": ("aten::index_select", "aten::index_add_", "aten::index", "aten::gather"),
         "copy / fill / cat": ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::clone"),
         "optimizer": ("aten::_fused_adamw_", "Optimizer.step")}


def batch(sequences: int, seed: int = 0, vocab: int = 4096, n: int = 4, max_response: int = 96) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(sequences):
        if i % n == 0:
            prompt = torch.randint(258, vocab, (int(torch.randint(8, 65, (), generator=g)),), generator=g).tolist()
        length = int(min(max_response, 1 + torch.empty(()).exponential_(0.015, generator=g)))
        prompts.append(prompt)
        responses.append(torch.randint(258, vocab, (length,), generator=g).tolist())
    t = sequence_tensors(prompts, responses, pad_id=0)
    t["advantages"] = torch.randn(t["response_mask"].shape, generator=g)
    return t


def grpo_loss(logp, mb, entropy=None):
    return algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"])[0], {}


def matmul_peak(tokens: int, hidden: int, inter: int, dtype: torch.dtype) -> float:
    """Best GFLOP/s of torch.mm in `dtype` on the update's shapes, in process CPU seconds (so
    that with T threads it is T times one thread's, as the update's times are)."""
    best = 0.0
    for k, n in ((hidden, 2 * inter), (inter, hidden), (hidden, 2 * hidden)):
        a, b = torch.randn(tokens, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(4):
            t = time.process_time()
            a @ b
            best = max(best, 2 * tokens * k * n / max(time.process_time() - t, 1e-9) / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--model", default="25m", choices=["25m", "qwen3-0.6b"])
    ap.add_argument("--model-path", default="", help="a Hugging Face directory (a real model) instead of --model")
    ap.add_argument("--n", type=int, default=4, help="samples sharing each prompt")
    ap.add_argument("--max-response", type=int, default=96)
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--dtype", default="auto", help="the compute dtype (auto: as hflow picks for the model)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
        c = model.config
        size = {"hidden": c.hidden_size, "inter": c.intermediate_size, "vocab": c.vocab_size}
        args.model = Path(args.model_path).name
    else:
        size = SIZES[args.model]
        model = make_model(size, 0.015)
    dtype = auto_param_dtype(torch.device("cpu"), size["hidden"]) if args.dtype == "auto" else getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        actor = Actor(mesh, ActorConfig(model_path=model_dir, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                                        optim=OptimConfig(lr=1e-6),
                                        fsdp=FSDPConfig(param_dtype=str(dtype).removeprefix("torch."),
                                                        activation_checkpointing=args.activation_checkpointing)))
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    head_params = model.lm_head.weight.numel()
    del model
    t = batch(args.sequences, vocab=size.get("vocab", 4096), n=args.n, max_response=args.max_response)
    # each prompt's tokens once: its 4 samples share them in the packed passes
    tokens, predicted = int(packed_tokens(t).sum()), int(t["response_mask"].sum())
    floor_flop = 3 * 2 * (tokens * layer_params + predicted * head_params)
    phases: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.process_time()
            out = fn(*a, **kw)
            phases[name] = phases.get(name, 0.0) + time.process_time() - start
            return out
        return wrapper
    actor._log_probs = timed("forward", actor._log_probs)
    actor.optimizer.step = timed("optimizer", actor.optimizer.step)
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")   # our timing wrapper
    backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", backward)
    print(f"{args.sequences} sequences, {int(t['attention_mask'].sum())} tokens, {tokens} once each prompt "
          f"is shared ({predicted} predicted); {args.model}, {str(dtype).removeprefix('torch.')} compute, "
          f"{args.threads} thread(s)")
    for i in range(args.updates):
        phases.clear()
        start, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        actor.update(t, grpo_loss)
        total = time.process_time() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"update {i}: {total:.3f} s CPU ({', '.join(f'{k} {v:.3f}' for k, v in phases.items())}), "
              f"{faults * resource.getpagesize() / 2**30:.1f} GiB of pages first touched"
              + (" (warm-up)" if i == 0 else ""), flush=True)
    torch.Tensor.backward = backward
    print(f"peak resident: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    peak = matmul_peak(tokens, size["hidden"], size["inter"], dtype)
    print(f"matmul floor: {floor_flop / 1e9:.0f} GFLOP / {peak:.0f} GFLOP/s = {floor_flop / peak / 1e9:.2f} s")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            actor.update(t, grpo_loss)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        shares: dict[str, float] = {}
        for e in events:
            kind = next((k for k, names in KINDS.items() if any(n in e.key for n in names)),
                        "other aten ops (elementwise...)" if e.key.startswith("aten::") else "other")
            shares[kind] = shares.get(kind, 0.0) + e.self_cpu_time_total
        for kind, value in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:>32}: {100 * value / total:5.1f} %")
        print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
