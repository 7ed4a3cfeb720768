"""The multiply task as chat prompts that show a model its calculator: one worked exchange first.

A chat template without a tools field (SmolLM2's ChatML, most small models') can still carry a
tool: the call is text in an assistant turn, the result a `tool` message, as recipes/agent.py's
`calculator` environment has them. One demonstration before each problem is how the model learns
the tool exists; RL then decides how often it calls it:

    python examples/tool_prompts.py --out data/multiply_tool
    torchrun --nproc-per-node 2 recipes/agent.py --model.path smollm2-135m-instruct \
        --data.train-files data/multiply_tool/train.jsonl --data.val-files data/multiply_tool/val.jsonl \
        --reward.fn gsm8k_flexible

The held-out rows are the built-in multiply task's (the same seed and size), never in training.
SmolLM2-135M-Instruct with this one exchange calls the calculator in ~7 % of its samples at
temperature 0.7 and in none of its greedy answers; with two exchanges it calls greedily on
almost every problem, leaving RL nothing to learn (docs/real-model.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hflow.data import task_splits

# a 2-digit product: the task's own problems are 3-digit x 2-digit, so this one is never a problem
DEMONSTRATION = [{"role": "user", "content": "27*82="},
                 {"role": "assistant", "content": "<calc>27*82</calc>"},
                 {"role": "tool", "content": "2214"},
                 {"role": "assistant", "content": "2214"}]


def chat_rows(rows: list[dict]) -> list[dict]:
    return [{"prompt": [*DEMONSTRATION, {"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a directory: train.jsonl and val.jsonl go there")
    ap.add_argument("--seed", type=int, default=0, help="the task's split seed (--data.task-seed)")
    ap.add_argument("--eval-size", type=int, default=500, help="held-out problems (--data.task-eval-size)")
    args = ap.parse_args()
    train, held_out = task_splits("multiply", args.seed, args.eval_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", held_out)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in chat_rows(rows))
        print(f"{out / name}.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    main()
