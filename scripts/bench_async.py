"""Asynchronous GRPO against the synchronous placements, side by side in one run.

On scripts/bench_rl.py's workloads (the same random 25M Qwen2, prompts and reward; GRPO 16 x 4,
fp32, lr 1e-6), hflow's recipes/grpo.py on R ranks in three placements:

    colocate    every rank generates, then every rank trains (the hybrid engine);
    split       the actor on the first R/2 ranks, a rollout group on the rest, one waiting for
                the other (--trainer.async-steps 0 with a rollout set in the SPEC);
    async-k     the same ranks, generation for the next k steps while this one trains
                (--trainer.async-steps k);
    async-k-partial  the same with --trainer.partial-rollouts (--partial): a push is taken by the
                generation running between two engine steps instead of after it.

Per configuration: the median whole step, tokens/s, and each group's idle time a step: the
actor's is its wait for the rollout group's batch (time/wait_for_rollout_s) plus its push of the
weights (time/push_s: the transfer, and in async the wait for the rollout group to finish the
generation it is running — the actor's update, queued behind the push, waits too); the rollout
group's the time between its generations (time/rollout_idle_s: waiting for weights or for the
next call). Colocated, no group waits for another (each phase uses every rank). Ratios
are against colocate and split of the same R, measured in the same run, alternating rounds.

    python scripts/bench_async.py                             # vary, 2 ranks, 2 rounds (~15 min idle)
    python scripts/bench_async.py --workload equal --ranks 2,4 --async-steps 1,2
    python scripts/bench_async.py --async-steps 1 --partial   # + async-1-partial
    python scripts/bench_async.py --quick                     # a check that it all runs

On a CPU with C cores the R ranks share them (C // R threads each; 4 ranks on 2 cores take
turns), so a split halves each phase's cores: overlap can win back only what a phase leaves
idle, which is the GPU case's long tail. What a CPU cannot show: a GPU's generation is bound by
memory bandwidth and its training by FLOPs, so two groups of GPUs run their phases at the
speeds of a colocated one with half the data each, and the overlap is nearly free.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rl  # noqa: E402  (the workloads, the runs, the floors)


def placements(ranks: int, async_steps: list[int], partial: bool = False) -> list[tuple[str, list[str]]]:
    """(label, recipe flags) of each configuration on `ranks` ranks."""
    from hflow.planner.search import ranks_text

    half = ranks // 2
    spec = f"actor:{ranks_text(list(range(half)))};rollout:{ranks_text(list(range(half, ranks)))}"
    out = [("colocate", ["--trainer.placement", "colocate"])]
    if ranks >= 2:
        out.append(("split", ["--trainer.placement", spec, "--trainer.async-steps", "0"]))
        out += [(f"async-{k}", ["--trainer.placement", spec, "--trainer.async-steps", str(k)]) for k in async_steps]
        if partial:
            out += [(f"async-{k}-partial", ["--trainer.placement", spec, "--trainer.async-steps", str(k),
                                            "--trainer.partial-rollouts"]) for k in async_steps]
    return out


def idle(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else 0.0


def partial_note(rows: list[dict]) -> str:
    """Partial rollouts: the share of responses continued on newer weights, their tokens' mean staleness."""
    if not any("async/partial_fraction" in r for r in rows):
        return ""
    return (f" (continued {idle(rows, 'async/partial_fraction'):.0%}, tokens "
            f"{idle(rows, 'async/token_staleness_mean'):.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="vary", choices=["equal", "vary"])
    ap.add_argument("--ranks", default="2", help="rank counts to compare at, e.g. 2,4")
    ap.add_argument("--async-steps", default="1", help="the k of each async configuration, e.g. 1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (the pipeline fills)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--partial", action="store_true", help="also each async-k with --trainer.partial-rollouts")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 new tokens, 4 steps, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.warmup = 4, 1, 2
    # what bench_rl.prepare reads
    args.size, args.model, args.layers, args.bf16 = ("quick" if args.quick else "25m"), "25m", 0, False
    args.hflow_flags, args.trl_micro_batch = "", 64
    root = Path(tempfile.mkdtemp(prefix="bench_async."))
    try:
        spec = bench_rl.prepare(args.workload, args, root)
        b, n, t = spec["shapes"]["grpo"]
        print(f"== {args.workload}: {spec['arch']} fp32, GRPO {b} prompts x {n}, <= {t} new tokens, {spec['note']}")
        configs = [(r, label, flags) for r in map(int, args.ranks.split(","))
                   for label, flags in placements(r, [int(k) for k in args.async_steps.split(",")], args.partial)]
        results: dict = {}
        for rnd in range(args.rounds):
            for r, label, flags in configs:
                run_spec = {**spec, "extra": flags}
                rows = bench_rl.run_hflow(run_spec, "grpo", r, max(1, args.cores // r), f"{label}-{r}r-round{rnd}")
                results.setdefault((r, label), []).extend(rows[args.warmup:])
        print("\n| ranks | placement | step s | update s | tokens/s | vs colocate | vs split | actor idle s | "
              "rollout idle s | staleness |\n|---|---|---|---|---|---|---|---|---|---|")
        for (r, label), rows in results.items():
            rate = bench_rl.step_rate(spec, "grpo", rows)
            base = {other: bench_rl.step_rate(spec, "grpo", results[(r, other)])
                    for other in ("colocate", "split") if (r, other) in results}
            ratios = [f"{rate / base[o]:.2f}×" if o in base else "—" for o in ("colocate", "split")]
            step = statistics.median(row["time/step_s"] for row in rows)
            update = statistics.median(row["time/update_s"] for row in rows)
            print(f"| {r} | {label} | {step:.2f} | {update:.2f} | {rate:,.0f} | {ratios[0]} | {ratios[1]} | "
                  f"{idle(rows, 'time/wait_for_rollout_s') + idle(rows, 'time/push_s'):.2f} | {idle(rows, 'time/rollout_idle_s'):.2f} | "
                  f"{idle(rows, 'async/staleness_max'):.0f}{partial_note(rows)} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
