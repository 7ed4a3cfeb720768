"""A judge role on hand-made (question, right answer) and (question, wrong answer) pairs: its
verdicts, their scores by the parse rule, and its throughput. Run by tests/test_judge.py, and
by hand to measure (docs/recipes.md, "A generative judge"):

    python tests/programs/judge_pairs.py JUDGE_DIR OUT.json [--parse score|yes_no] [--copies K]

Outside torchrun it is a world of one (hflow.launch); under torchrun the rows are split over the ranks.
Writes OUT.json: rows (question, answer, right, verdict, score), verdicts_per_s, tokens_per_s, seconds.
"""
import argparse
import json
import time

import hflow
from hflow.rewards.judge import default_template, parse_verdict, render
from hflow.workers.judge import Judge, JudgeConfig

# (question, reference, right answer, wrong answer): arithmetic and facts a small model may know
PAIRS = [
    ("What is 2 + 2?", "4", "2 + 2 = 4.", "2 + 2 = 5."),
    ("What is the capital of France?", "Paris", "The capital of France is Paris.", "The capital of France is Berlin."),
    ("How many legs does a spider have?", "8", "A spider has 8 legs.", "A spider has 6 legs."),
    ("What is 10 times 3?", "30", "10 times 3 is 30.", "10 times 3 is 13."),
    ("What color is the sky on a clear day?", "blue", "The sky is blue.", "The sky is green."),
    ("How many days are in a week?", "7", "There are 7 days in a week.", "There are 10 days in a week."),
    ("What is the largest planet in the solar system?", "Jupiter", "Jupiter is the largest planet.",
     "Mercury is the largest planet."),
    ("What is 9 minus 4?", "5", "9 minus 4 is 5.", "9 minus 4 is 3."),
]


def main(cluster, args):
    rows = [{"question": q, "reference": ref, "answer": answer, "right": right}
            for q, ref, good, bad in PAIRS for answer, right in ((good, True), (bad, False))] * args.copies
    template = default_template(args.parse, (0, 10), with_reference=True)
    prompts = [render(template, r["question"], r["answer"], r["reference"]) for r in rows]
    judge = cluster.spawn(Judge, JudgeConfig(model_path=args.judge, max_tokens=args.max_tokens))
    judge.verdicts(hflow.Batch({"judge_prompt": prompts[:2]}))   # warm: the first call allocates the KV cache
    began = time.perf_counter()
    judged = judge.verdicts(hflow.Batch({"judge_prompt": prompts}))
    seconds = time.perf_counter() - began
    for row, verdict in zip(rows, judged["verdict"]):
        row["verdict"], row["score"] = verdict, parse_verdict(verdict, args.parse, (0, 10))
    tokens = judged["verdict_tokens"].sum().item()
    result = {"rows": rows, "seconds": seconds, "verdicts_per_s": len(rows) / seconds, "tokens_per_s": tokens / seconds,
              "verdict_tokens": tokens, "prompt_tokens": judged["prompt_tokens"].sum().item(),
              "ranks": cluster.world_size, "parse": args.parse}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    judge.close()
    return "JUDGE OK"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("judge")
    parser.add_argument("out")
    parser.add_argument("--parse", default="score", choices=["score", "yes_no"])
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    arguments = parser.parse_args()
    print(hflow.launch(lambda cluster, cfg: main(cluster, arguments)))
