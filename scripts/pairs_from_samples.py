"""Preference pairs from a model's own samples on a task: for recipes/dpo.py on a real model.

Each training prompt of the task's split (the one recipes/grpo.py --data.task and
scripts/learn_side_by_side.py use: the held-out problems are never drawn) is sampled --n times
by hflow's engine; a prompt whose samples hold a right answer (the task's reward 1) and a wrong
one gives a pair, a right one chosen, a wrong one rejected (each drawn at random among its kind).
The first eighth of the pairs (at least 32, at most half) go to val.jsonl, the rest to train.jsonl, as
{"prompt": [chat messages], "chosen": text, "rejected": text}.

    python scripts/pairs_from_samples.py --model-path DIR --prompts 480 --out pairs/
    torchrun --nproc-per-node 2 recipes/dpo.py --model.path DIR --data.train-files pairs/train.jsonl \
        --data.val-files pairs/val.jsonl --data.batch-size 16 --steps 18 --actor.optim.lr 1e-5
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_side_by_side import TASK_ARGS, score, splits  # noqa: E402  (the same split and scorer)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a Hugging Face directory (chat model)")
    p.add_argument("--task", default="rg:chain_sum")
    p.add_argument("--task-args", nargs="*", default=TASK_ARGS)
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--task-size", type=int, default=3000)
    p.add_argument("--eval-size", type=int, default=256, help="held-out problems left out, as the GRPO runs")
    p.add_argument("--prompts", type=int, default=480, help="training prompts sampled")
    p.add_argument("--n", type=int, default=8, help="samples a prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for train.jsonl and val.jsonl")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from hflow.engine import LLM, SamplingParams

    train, _ = splits(a)
    rows = train[:a.prompts]
    tokenizer = AutoTokenizer.from_pretrained(a.model_path)
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    llm = LLM.from_pretrained(a.model_path, dtype=torch.float32)
    start = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(n=a.n, temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed),
                        use_tqdm=True)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"{tokens} tokens sampled in {time.perf_counter() - start:.0f} s")
    rng, pairs = random.Random(a.seed), []
    for row, out in zip(rows, outs):
        responses = tokenizer.batch_decode([c.token_ids for c in out.outputs], skip_special_tokens=True)
        scored = [(text, score(text, row["answer"], row["extra"])) for text in responses]
        right = [text for text, s in scored if s == 1.0]
        wrong = [text for text, s in scored if s < 1.0]
        if right and wrong:
            pairs.append({"prompt": row["prompt"], "chosen": rng.choice(right), "rejected": rng.choice(wrong)})
    held = min(max(32, len(pairs) // 8), len(pairs) // 2)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("val", pairs[:held]), ("train", pairs[held:])):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(pair) + "\n" for pair in part)
    print(f"{len(pairs)} pairs from {len(rows)} prompts: {len(pairs) - held} to train.jsonl, {held} to val.jsonl")


if __name__ == "__main__":
    main()
