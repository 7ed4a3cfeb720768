"""python -m hflow.engine --model DIR --prompt "..."  — print completions of a prompt.

Uses the tokenizer saved in DIR; greedy unless --temperature > 0. Weights and KV cache in
bf16 on CUDA and fp32 on CPU unless --dtype says otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def default_dtype(device: str) -> torch.dtype:
    """bf16 on GPUs (their matmul units; fp32 would double memory and time), fp32 on CPU (no
    fast bf16 there)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def completion_label(prompt: int, prompts: int, sample: int, n: int, text: str) -> str:
    """The line above each completion when there are several: `--- prompt 2/3 'text', sample 1/4 ---`."""
    where = f"prompt {prompt + 1}/{prompts} {text!r}" if prompts > 1 else f"{text!r}"
    return f"--- {where}" + (f", sample {sample + 1}/{n}" if n > 1 else "") + " ---"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hflow.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (with its tokenizer)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--n", type=int, default=1, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    from hflow.engine import LLM, SamplingParams

    dtype = default_dtype(args.device) if args.dtype == "auto" else getattr(torch, args.dtype)
    llm = LLM.from_pretrained(args.model, dtype=dtype, device=args.device)
    if llm.tokenizer is None:
        ap.error(f"{args.model} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outs = llm.generate(args.prompt, params)   # strings: the engine tokenizes them
    elapsed = time.perf_counter() - start
    num_tokens = 0
    labelled = len(outs) > 1 or args.n > 1
    for i, out in enumerate(outs):
        for completion in out.outputs:
            num_tokens += len(completion.token_ids)
            if labelled:
                print(completion_label(i, len(outs), completion.index, args.n, out.prompt))
            print(completion.text)
    print(f"[{num_tokens} tokens in {elapsed:.2f} s]", file=sys.stderr)


if __name__ == "__main__":
    main()
