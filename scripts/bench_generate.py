"""Generation throughput, side by side in one process: hflow.engine vs transformers.

Workloads (`--workload`), each on a random Qwen2, fp32, sampling at temperature 1:
  large       (the default) 32 prompts of 8-96 tokens x n=4, <= 96 new tokens, lengths vary
              (mean ~50); ~25M params (hidden 512, 8 layers, 8 query / 4 KV heads, vocab 4096).
  default     the recipes' embedded default task: 32 prompts of 6-8 tokens ("12+35=") x n=8,
              <= 5 new tokens (EOS prob 0.2/token: mean ~3.4, as a trained policy answers
              "47<eos>"); the default model's size (hidden 256, 4 layers, vocab 512).
  grpo-equal  16 prompts of 8-64 tokens x n=4, <= 32 new tokens, no EOS (all full length); 25M.
  grpo-vary   the same with <= 96 new tokens and EOS prob 0.015 (mean length ~50).
  gpu-0.5b    for a GPU (--device cuda): Qwen2.5-0.5B's shape (494M params, vocab 151,936), 64
              prompts of 32-256 tokens x n=4, <= 256 new tokens, EOS prob 0.004 (mean ~200).
The three recipe workloads run the engine as the recipes' rollout does: the default KV budget
(256 sequences of max_model_len = 256 tokens, <= 1 GiB), and between calls (untimed) asleep
at level 2, woken up and loaded with the weights again, so that every timed generate()
allocates its KV cache and packs its weights (if it does) again. `--per-rank` runs one rank's share of a 2-rank run: half the prompts on one thread.
The random model's next-token distribution is almost uniform; its EOS logit is lifted by a
constant so that every step ends a sequence with probability ~--eos-prob.

Peers (same model, same prompts): `generate` on one left-padded batch with
num_return_sequences=n, and `generate_batch` (transformers' own continuous batching).
Each engine runs once untimed on a small batch (warm-up), then the timed workload
(--repeat times, interleaved across engines, best kept). Throughput = generated tokens (up to
and including EOS) / wall time. The process CPU time is printed too: on a shared machine a
wall time far above it means the run was starved.

`--profile` runs only hflow: the mean wall time of a decode step (plain, then under
torch.profiler split into scheduling/bookkeeping, metadata, forward, sampling), the time in
torch ops per decode step (the sum of every op's self CPU time inside the step), the Python
overhead = profiled step wall time - time in torch ops, and the top ops.

    python scripts/bench_generate.py                     # the full comparison (~1 min idle)
    python scripts/bench_generate.py --workload grpo-equal --per-rank --peers generate --repeat 5
    python scripts/bench_generate.py --workload default --profile
    python scripts/bench_generate.py --workload gpu-0.5b --device cuda --peers generate   # bf16
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch


# model sizes: hidden, layers, query heads, KV heads, intermediate, vocab
SIZES = {"25m": (512, 8, 8, 4, 1376, 4096), "default": (256, 4, 4, 2, 1024, 512),
         "0.5b": (896, 24, 14, 2, 4864, 151936)}
# model, prompts, n, prompt lengths, max new tokens, EOS prob per token
WORKLOADS = {
    "large": dict(size="25m", prompts=32, n=4, lengths=(8, 96), max_new_tokens=96, eos_prob=0.015, recipe=False),
    "default": dict(size="default", prompts=32, n=8, lengths=(6, 8), max_new_tokens=5, eos_prob=0.2, recipe=True),
    "grpo-equal": dict(size="25m", prompts=16, n=4, lengths=(8, 64), max_new_tokens=32, eos_prob=0.0, recipe=True),
    "grpo-vary": dict(size="25m", prompts=16, n=4, lengths=(8, 64), max_new_tokens=96, eos_prob=0.015, recipe=True),
    "gpu-0.5b": dict(size="0.5b", prompts=64, n=4, lengths=(32, 256), max_new_tokens=256, eos_prob=0.004,
                     recipe=False),
}


def make_model(size: str, eos_prob: float, seed: int = 0, max_len: int = 512):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    eos = vocab - 1
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    model = Qwen2ForCausalLM(cfg).eval()
    # Hidden dim 0 of every embedding is a constant 1, so after the final RMSNorm h[0] is large
    # and nearly constant; the EOS row gets an extra +delta there: logit_eos - logit_other ~ h0*delta.
    emb = model.model.embed_tokens.weight.data
    emb[:, 0] = 1.0
    prompts = torch.randint(0, vocab, (16, 64))
    with torch.no_grad():
        h0 = model.model(prompts).last_hidden_state[..., 0].mean().item()
    eos_prob = max(eos_prob, 1e-9)  # 0: EOS practically never sampled
    delta = math.log(eos_prob * (vocab - 1) / (1 - eos_prob)) / h0
    emb[eos, 0] = 1.0 + delta
    return model, eos


def make_prompts(num: int, lengths: tuple[int, int], vocab: int, eos: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g)
        out.append([int(t) + (int(t) >= eos) for t in ids])  # no EOS inside prompts
    return out


def count_until_eos(tokens: list[int], eos: int) -> int:
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def setup_hflow(model, prompts, n, max_new, eos, seed, recipe=False):
    """Build the engine and warm it up; return the timed call. `recipe`: as the recipes' rollout
    runs it, with the default KV budget, asleep and given its weights again between calls."""
    from hflow.engine import LLM, SamplingParams

    weights = next(model.parameters())
    if recipe:
        options = dict(max_num_seqs=256)
    else:
        per_seq = -(-(max(map(len, prompts)) + max_new) // 16)
        options = dict(num_kv_blocks=len(prompts) * n * per_seq + 64, max_num_seqs=len(prompts) * n)
    llm = LLM(model.config, dtype=weights.dtype, device=weights.device, block_size=16, **options)
    llm.load_weights(model.state_dict().items())
    llm.generate(prompts[:4], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=seed))

    def prepare():  # untimed: what the rollout does between two generate() calls
        llm.sleep(level=2)
        llm.wake_up()
        llm.load_weights(model.state_dict().items())

    def run():
        outs = llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_new, seed=seed))
        return sum(len(c.token_ids) for o in outs for c in o.outputs)
    run.llm, run.prepare = llm, prepare if recipe else None
    return run


def setup_generate(model, prompts, n, max_new, eos, seed):
    def go(batch, new):
        width = max(map(len, batch))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, num_return_sequences=n, max_new_tokens=new, eos_token_id=eos,
                                 pad_token_id=eos)
        return sum(count_until_eos(row[width:].tolist(), eos) for row in out)
    torch.manual_seed(seed)
    go(prompts[:4], 8)
    return lambda: go(prompts, max_new)


def setup_generate_batch(model, prompts, n, max_new, eos, seed):
    from transformers import GenerationConfig

    def go(batch, new):
        cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                               max_new_tokens=new, eos_token_id=eos, pad_token_id=eos)
        outs = model.generate_batch(inputs=batch, generation_config=cfg, progress_bar=False)
        return sum(count_until_eos(list(o.generated_tokens), eos) for o in outs.values())
    torch.manual_seed(seed)
    go(prompts[:4], 8)
    return lambda: go(prompts, max_new)


ENGINES = {"hflow": setup_hflow, "generate": setup_generate, "generate_batch": setup_generate_batch}


# the engine's methods timed by --profile (label -> (owner, attribute)); a decode step's share
CATEGORIES = {"scheduling/bookkeeping": ("schedule", "postprocess"), "metadata": ("prepare",),
              "model forward": ("forward", "logits"), "sampling": ("sample",)}


def profile_hflow(run, repeat: int) -> None:
    """Decode-step wall time, plain and under torch.profiler, split by engine phase."""
    from contextlib import ExitStack
    from unittest import mock

    import hflow.engine.model_runner as model_runner
    from torch.profiler import ProfilerActivity, profile, record_function

    llm = run.llm
    plain: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # (wall, process CPU)
    kinds: list[bool] = []   # is_prefill of each step, as the scheduler decided it

    def noted_schedule(schedule=llm.scheduler.schedule):
        seqs, is_prefill = schedule()
        kinds.append(is_prefill)
        return seqs, is_prefill

    def timed_step(step=llm.step):
        t, cpu = time.perf_counter(), time.process_time()
        finished = step()
        plain[kinds[-1]].append((time.perf_counter() - t, time.process_time() - cpu))
        return finished

    def labelled(fn, label):
        def wrapped(*a, **k):
            with record_function("hflow::" + label):
                return fn(*a, **k)
        return wrapped
    targets = {"step": (llm, "step"), "schedule": (llm.scheduler, "schedule"),
               "postprocess": (llm.scheduler, "postprocess"), "prepare": (llm.runner, "_prepare_decode"),
               "forward": (llm.model, "forward"), "logits": (llm.model, "compute_logits"),
               "sample": (model_runner, "sample")}
    with mock.patch.object(llm, "step", timed_step), mock.patch.object(llm.scheduler, "schedule", noted_schedule):
        for _ in range(repeat):
            run.prepare and run.prepare()
            run()
    profs = []
    with ExitStack() as patches:
        for label, (owner, attr) in targets.items():
            patches.enter_context(mock.patch.object(owner, attr, labelled(getattr(owner, attr), label)))
        for _ in range(repeat):
            run.prepare and run.prepare()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            profs.append(prof)

    def walk(e):
        for c in e.cpu_children:
            yield c
            yield from walk(c)
    decode = []  # per decode step: wall, {label: time}, time in ops, top-level op calls
    for e in (e for prof in profs for e in prof.events() if e.name == "hflow::step"):
        inner = list(walk(e))
        labels: dict[str, float] = {}
        for c in inner:
            if c.name.startswith("hflow::"):
                labels[c.name[7:]] = labels.get(c.name[7:], 0.0) + c.cpu_time_total
        if "prepare" in labels:  # a decode step
            ops = [c for c in inner if not c.name.startswith("hflow::")]
            top = [c for c in ops if c.cpu_parent is None or c.cpu_parent.name.startswith("hflow::")]
            decode.append((e.cpu_time_total, labels, sum(c.self_cpu_time_total for c in ops), len(top)))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    wall, in_ops = mean([d[0] for d in decode]) / 1e3, mean([d[2] for d in decode]) / 1e3
    wall_cpu = lambda xs: f"{1e3 * mean([x[0] for x in xs]):.2f} ms (CPU {1e3 * mean([x[1] for x in xs]):.2f})"  # noqa: E731
    print(f"decode steps: {len(decode) // repeat} per run; unprofiled: decode {wall_cpu(plain[False])}/step, "
          f"prefill {wall_cpu(plain[True])}/step ({len(plain[True]) // repeat} per run)")
    print(f"under the profiler: {wall:.2f} ms/step, of which")
    shown = 0.0
    for cat, labels in CATEGORIES.items():
        t = mean([sum(d[1].get(x, 0.0) for x in labels) for d in decode]) / 1e3
        shown += t
        print(f"  {cat:>24}: {t:6.2f} ms ({100 * t / wall:4.1f} %)")
    print(f"  {'other (in step)':>24}: {wall - shown:6.2f} ms ({100 * (wall - shown) / wall:4.1f} %)")
    print(f"time in torch ops {in_ops:.2f} ms/step ({mean([d[3] for d in decode]):.0f} top-level op calls); "
          f"Python overhead = step - ops = {wall - in_ops:.2f} ms/step ({100 * (1 - in_ops / wall):.0f} %)")
    print(f"top ops of the last run:\n{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=15)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="large")
    ap.add_argument("--prompts", type=int, help="default: the workload's")
    ap.add_argument("--n", type=int, help="default: the workload's")
    ap.add_argument("--max-new-tokens", type=int, help="default: the workload's")
    ap.add_argument("--eos-prob", type=float, help="per-token EOS probability; default: the workload's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-rank", action="store_true",
                    help="one rank of a 2-rank run: half the prompts, on 1 thread")
    ap.add_argument("--peers", default="generate,generate_batch", help="comma list, or '' for hflow only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per engine (interleaved); best is kept")
    ap.add_argument("--profile", action="store_true", help="profile hflow's decode steps (no peers)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    for key in ("prompts", "n", "max_new_tokens", "eos_prob"):
        if getattr(args, key) is None:
            setattr(args, key, w[key])
    if args.per_rank:
        args.prompts, args.threads = args.prompts // 2, 1

    torch.set_num_threads(args.threads)
    model, eos = make_model(w["size"], args.eos_prob, args.seed, max_len=256 if w["recipe"] else 512)
    from hflow.engine.__main__ import default_dtype
    dtype = default_dtype(args.device) if args.dtype == "auto" else getattr(torch, args.dtype)
    model.to(device=args.device, dtype=dtype)
    prompts = make_prompts(args.prompts, w["lengths"], model.config.vocab_size, eos, args.seed + 1)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {params / 1e6:.1f}M params, {str(dtype)[6:]} on {args.device}, {args.threads} threads; "
          f"workload {args.workload}: "
          f"{args.prompts} prompts of {w['lengths'][0]}-{w['lengths'][1]} tokens x n={args.n}, "
          f"<= {args.max_new_tokens} new tokens, EOS prob {args.eos_prob}/token")
    if args.profile:
        return profile_hflow(setup_hflow(model, prompts, args.n, args.max_new_tokens, eos, args.seed,
                                         w["recipe"]), args.repeat)

    names = ["hflow"] + [p for p in args.peers.split(",") if p]
    runs = {name: ENGINES[name](model, prompts, args.n, args.max_new_tokens, eos, args.seed,
                                **({"recipe": w["recipe"]} if name == "hflow" else {})) for name in names}
    best: dict[str, tuple[float, int, float, float]] = {}
    load_before = os.getloadavg()[0]
    for rep in range(args.repeat):  # interleaved, so that a busy spell hits every engine alike
        for name in names:
            if getattr(runs[name], "prepare", None):
                runs[name].prepare()
            cpu, start = time.process_time(), time.perf_counter()
            tokens = runs[name]()
            dt, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"  [{rep + 1}/{args.repeat}] {name}: {tokens} tokens in {dt:.3f} s "
                  f"(process CPU {cpu:.1f} s)", flush=True)
            if name not in best or tokens / dt > best[name][0]:
                best[name] = (tokens / dt, tokens, dt, cpu)
    # a reading taken while other processes held the cores is no evidence of a regression: the
    # engine's short runs and the peers' long ones meet the busy spells unequally (this process's
    # own --threads count in the load average)
    load_after = os.getloadavg()[0]
    print(f"machine load (1-min average) {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs, "
          f"{args.threads} of it this run's"
          + (": busy, the ratio below is not comparable with an idle machine's" if max(load_before, load_after)
             > args.threads + 1 else ""))
    print(f"best of {args.repeat}:")
    for name in names:
        rate, tokens, dt, cpu = best[name]
        print(f"{name:>15}: {tokens:6d} tokens in {dt:6.3f} s = {rate:7.1f} tok/s "
              f"(process CPU {cpu:.3f} s; mean completion {tokens / (args.prompts * args.n):.1f} tokens)")
    peers = {k: v[0] for k, v in best.items() if k != "hflow"}
    if peers:
        faster = max(peers, key=peers.get)
        print(f"hflow / {faster} (the faster peer) = {best['hflow'][0] / peers[faster]:.2f}x")


if __name__ == "__main__":
    main()
