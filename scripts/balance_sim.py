"""How evenly `@dispatch("dp", balance=packed_row_tokens)` spreads a GRPO batch's training work over ranks.

Simulates bench_rl's vary workload (16 prompts of 8-64 tokens x 4 samples; responses end with
probability 0.015 per token, at most 96) and counts each rank's packed tokens: every response,
and each prompt once per rank that holds any of its samples (workers/packing.py packs it once).
Prints the busiest rank's tokens for a plain cut, for balancing row by row (which splits a
prompt's samples over ranks) and for hflow's balancing by prompt, relative to the last, plus the
busiest rank's excess over the mean.

    python scripts/balance_sim.py [--batches 2000]
"""
import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hflow.runtime.dispatch import balanced_order  # noqa: E402

PROMPTS, N, EOS_PROB, MAX_TOKENS = 16, 4, 0.015, 96


def response_length(rng: random.Random) -> int:
    return next((t for t in range(1, MAX_TOKENS) if rng.random() < EOS_PROB), MAX_TOKENS)


def rank_loads(order: list[int], shards: int, prompt: list[int], response: list[int]) -> list[int]:
    m = len(order) // shards
    loads = []
    for s in range(shards):
        rows = order[s * m:(s + 1) * m]
        loads.append(sum(response[r] for r in rows) + sum(prompt[g] for g in {r // N for r in rows}))
    return loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    for shards in (2, 4):
        busiest = {"plain cut": [], "row by row": [], "by prompt": []}
        excess = []
        for _ in range(args.batches):
            prompt = [rng.randint(8, 64) for _ in range(PROMPTS)]
            response = [response_length(rng) for _ in range(PROMPTS * N)]
            full = [prompt[r // N] + response[r] for r in range(PROMPTS * N)]
            once = [prompt[r // N] * (r % N == 0) + response[r] for r in range(PROMPTS * N)]
            orders = {"plain cut": list(range(PROMPTS * N)), "row by row": balanced_order(full, shards),
                      "by prompt": balanced_order(once, shards, unit=N)}
            for name, order in orders.items():
                loads = rank_loads(order, shards, prompt, response)
                busiest[name].append(max(loads))
            excess.append(max(loads) / statistics.mean(loads) - 1)
        base = statistics.mean(busiest["by prompt"])
        print(f"{shards} ranks: busiest rank's packed tokens vs balancing by prompt: " + ", ".join(
            f"{name} {statistics.mean(v) / base:.3f}" for name, v in busiest.items())
            + f"; by prompt, the busiest is {100 * statistics.mean(excess):.1f} % above the mean")


if __name__ == "__main__":
    main()
