"""Generation throughput, side by side in one process: hflow.engine vs transformers.

RL-shaped workload: P prompts of 8-96 random tokens, n samples each, temperature 1, up to
96 new tokens, on a random ~25M-parameter Qwen2 (hidden 512, 8 layers, 8 query / 4 KV heads,
vocab 4096, tied embeddings), fp32. The random model's next-token distribution is almost
uniform; its EOS logit is lifted by a constant so that every step ends a sequence with
probability ~--eos-prob, which gives completion lengths that vary like an RL batch's.

Peers (same model, same prompts): `generate` on one left-padded batch with
num_return_sequences=n, and `generate_batch` (transformers' own continuous batching).
Each engine runs once untimed on a small batch (warm-up), then the timed workload
(--repeat times, interleaved across engines, best kept). Throughput = generated tokens (up to
and including EOS) / wall time. The process CPU time is printed too: on a shared machine a
wall time far above it means the run was starved.

    python scripts/bench_generate.py                     # the full comparison (~1 min idle)
    python scripts/bench_generate.py --prompts 8 --peers generate   # a quick look
"""
from __future__ import annotations

import argparse
import math
import time

import torch


def make_model(vocab: int, eos: int, eos_prob: float, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    model = Qwen2ForCausalLM(cfg).eval()
    # Hidden dim 0 of every embedding is a constant 1, so after the final RMSNorm h[0] is large
    # and nearly constant; the EOS row gets an extra +delta there: logit_eos - logit_other ~ h0*delta.
    emb = model.model.embed_tokens.weight.data
    emb[:, 0] = 1.0
    prompts = torch.randint(0, vocab, (16, 64))
    with torch.no_grad():
        h0 = model.model(prompts).last_hidden_state[..., 0].mean().item()
    delta = math.log(eos_prob * (vocab - 1) / (1 - eos_prob)) / h0
    emb[eos, 0] = 1.0 + delta
    return model


def make_prompts(num: int, vocab: int, eos: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        length = int(torch.randint(8, 97, (), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g)
        out.append([int(t) + (int(t) >= eos) for t in ids])  # no EOS inside prompts
    return out


def count_until_eos(tokens: list[int], eos: int) -> int:
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def setup_hflow(model, prompts, n, max_new, eos, seed):
    """Build the engine and warm it up; return the timed call."""
    from hflow.engine import LLM, SamplingParams

    llm = LLM(model, block_size=16, num_kv_blocks=len(prompts) * n * (96 + max_new) // 16 + 64,
              max_num_seqs=len(prompts) * n)
    llm.generate(prompts[:4], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=seed))

    def run():
        outs = llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_new, seed=seed))
        return sum(len(c.token_ids) for o in outs for c in o.outputs)
    return run


def setup_generate(model, prompts, n, max_new, eos, seed):
    def go(batch, new):
        width = max(map(len, batch))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--eos-prob", type=float, default=0.015, help="per-token EOS probability")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default="generate,generate_batch", help="comma list, or '' for hflow only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per engine (interleaved); best is kept")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    eos = args.vocab - 1
    model = make_model(args.vocab, eos, args.eos_prob, args.seed)
    prompts = make_prompts(args.prompts, args.vocab, eos, args.seed + 1)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {params / 1e6:.1f}M params, fp32, {args.threads} threads; workload: {args.prompts} "
          f"prompts x n={args.n}, <= {args.max_new_tokens} new tokens, EOS prob {args.eos_prob}/token")

    names = ["hflow"] + [p for p in args.peers.split(",") if p]
    runs = {name: ENGINES[name](model, prompts, args.n, args.max_new_tokens, eos, args.seed) for name in names}
    best: dict[str, tuple[float, int, float]] = {}
    for rep in range(args.repeat):  # interleaved, so that a busy spell hits every engine alike
        for name in names:
            cpu, start = time.process_time(), time.perf_counter()
            tokens = runs[name]()
            dt, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"  [{rep + 1}/{args.repeat}] {name}: {tokens} tokens in {dt:.2f} s "
                  f"(process CPU {cpu:.1f} s)", flush=True)
            if name not in best or tokens / dt > best[name][0]:
                best[name] = (tokens / dt, tokens, dt)
    print(f"best of {args.repeat}:")
    for name in names:
        rate, tokens, dt = best[name]
        print(f"{name:>15}: {tokens:6d} tokens in {dt:6.2f} s = {rate:7.1f} tok/s "
              f"(mean completion {tokens / (args.prompts * args.n):.1f} tokens)")
    peers = {k: v[0] for k, v in best.items() if k != "hflow"}
    if peers:
        faster = max(peers, key=peers.get)
        print(f"hflow / {faster} (the faster peer) = {best['hflow'][0] / peers[faster]:.2f}x")


if __name__ == "__main__":
    main()
