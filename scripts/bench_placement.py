"""PPO's placements on 4 CPU ranks: the planner's predicted step times beside measured ones.

    python scripts/bench_placement.py                          # colocate, split, standalone; 2 rounds
    python scripts/bench_placement.py --rounds 1 --steps 3     # quicker
    python scripts/bench_placement.py --recipe my_ppo.py       # a recipe copy wired to hflow.placement.resolve

1. Measures this machine's CPU profile as 4 ranks of one thread each (torchrun's default):
   a rank's matmul FLOP/s and memory bandwidth, gloo between two processes, the cores.
2. Prices each placement of PPO's actor, reference and critic (the recipe's defaults on the
   embedded default model: 32 prompts x 4 samples, the task's prompt length, <= 5 new tokens,
   one optimizer step) with hflow.planner.fsdp's planner, and lists `auto`'s candidates.
3. Runs `recipes/ppo.py --trainer.placement P` under torchrun for each placement, round after
   round (so that a change of the machine's load hits every placement alike), with
   --algo.critic-warmup 0 so that the actor trains every step, as the planner assumes.
4. Prints, per placement: predicted seconds (generation / preparation / training = step) for
   a machine of its own and for the machine as loaded during the runs, the busy rank-seconds
   a step, measured median seconds of the same phases (the recipe's time/generate,
   time/log_probs, time/update, time/step) and the ranks' CPU-seconds a step (from /proc),
   others' runnable processes before each run, and whether the rankings agree.

The machine is shared. Others' runnable processes (/proc/loadavg's count, sampled for a second
before each run; the load average would remember the previous run) take their share of the
cores: the planner's `background`. A rank then gets less than a core however few of ours are
busy, so a set on one rank becomes the critical path sooner than on a quiet machine. The
ranks' CPU-seconds change little with load; the busy rank-seconds predict them. A placement
the recipe does not accept yet (until it calls hflow.placement.resolve) is reported and skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

RANKS = 4
PHASES = [("generation", "time/generate_s"), ("preparation", "time/log_probs_s"), ("training", "time/update_s")]


def recipe_job(recipe: Path, size: str):
    """The Job `auto` would price for the recipe's default Config on the embedded model."""
    from transformers import AutoTokenizer

    from hflow.data import load_prompts
    from hflow.default import default_model_dir
    from hflow.placement import job_of

    spec = importlib.util.spec_from_file_location("bench_recipe", recipe)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    cfg = module.Config()
    model_dir = default_model_dir(size)
    train = load_prompts(cfg.data, AutoTokenizer.from_pretrained(model_dir), "train")
    return job_of(cfg, str(model_dir), train, actor_log_probs=False)   # fp32 on CPU: the engine's log-probs


def partition_of(placement) -> tuple[list[tuple[str, ...]], list[int]]:
    """The colocated sets of a Placement (roles on the same ranks) and their sizes."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for role, ranks in placement.items():
        groups.setdefault(tuple(ranks), []).append(role)
    return [tuple(roles) for roles in groups.values()], [len(ranks) for ranks in groups]


def busy_rank_seconds(plan) -> float:
    """Rank-seconds a step keeps ranks busy: each set's devices x its time, every stage."""
    return sum(s.devices * t for s in plan.sets for t in s.stage_times)


def rank_pids(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(entry))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")    # utime + stime
    return total


def run(recipe: Path, placement: str, steps: int, size: str, out: Path) -> dict:
    """One torchrun of the recipe: per-step rows of metrics.jsonl, each with its ranks' CPU-seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", str(recipe),
           "--trainer.placement", placement, "--trainer.steps", str(steps), "--algo.critic-warmup", "0",
           "--model.default-size", size, "--trainer.eval-size", "8", "--trainer.no-export",
           "--trainer.output-dir", str(out), "--rollout.no-progress", "--trainer.logging.no-progress-bars"]
    metrics, log = out / "metrics.jsonl", out.with_suffix(".log")
    marks, done = [], threading.Event()

    def watch(parent: int):    # the ranks' CPU-seconds each time a step's line lands
        while not done.is_set():
            lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if lines > len(marks):
                marks.extend([cpu_seconds(rank_pids(parent))] * (lines - len(marks)))
            time.sleep(0.02)

    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        watcher = threading.Thread(target=watch, args=(proc.pid,), daemon=True)
        watcher.start()
        rc = proc.wait()
        done.set()
        watcher.join()
    output = log.read_text()
    if rc != 0:
        if "invalid choice" in output and f"'{placement}'" in output:     # tyro refusing the flag's value
            return {"refused": True}
        raise RuntimeError(f"exit status {rc}: {' '.join(cmd)}\n--- {log} (tail)\n{output[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for row, before, after in zip(rows[1:], marks, marks[1:]):
        if "eval/reward_mean" not in row:      # a line after an evaluation also paid for it
            row["cpu_s"] = after - before
    return {"rows": [r for r in rows if "time/step_s" in r]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--placements", default="colocate,split,standalone")
    ap.add_argument("--steps", type=int, default=4, help="timed steps a run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of a run left out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="default", choices=["tiny", "default", "25m"], help="embedded default model")
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "ppo.py"))
    args = ap.parse_args()

    from hflow.placement import resolve
    from hflow.placement.auto import candidates, describe, planner_for
    from hflow.planner.hardware import cpu_profile, runnable_others

    recipe, names = Path(args.recipe).resolve(), args.placements.split(",")
    sets = [["actor", "ref"], ["critic"]]          # PPO's split: kl_coef > 0, no reward model
    print(f"measuring the CPU profile ({runnable_others():.1f} runnable processes of others) ...", flush=True)
    hw = cpu_profile(RANKS, threads_per_rank=1)
    print(f"  a rank: {hw.peak_flops / 1e9:.0f} GFLOP/s fp32 matmul, {hw.memory_bandwidth / 1e9:.1f} GB/s memory; gloo "
          f"{hw.nvlink_bandwidth / 1e9:.3f} GB/s, {hw.nvlink_latency * 1e6:.0f} us; {hw.cores} cores for {RANKS} "
          f"ranks ({runnable_others():.1f} runnable of others; load average {os.getloadavg()[0]:.1f})")
    job = recipe_job(recipe, args.size)
    planner = planner_for(sets, RANKS, "ppo", job, hw)
    print("\n".join(describe(candidates(planner, sets), planner, sets)), flush=True)

    measured, others = {name: [] for name in names}, []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names:
                if measured[name] is None:
                    continue
                before = runnable_others()
                result = run(recipe, name, args.warmup + args.steps, args.size, Path(tmp) / f"{name}{r}")
                if result.get("refused"):
                    print(f"  {name}: {recipe.name} does not accept --trainer.placement {name} yet", flush=True)
                    measured[name] = None
                    continue
                others.append(before)
                rows = result["rows"][args.warmup:]
                measured[name] += [dict(x, others=others[-1]) for x in rows]
                print(f"  round {r + 1} {name}: step {statistics.median(x['time/step_s'] for x in rows):.2f} s "
                      f"({others[-1]:.1f} runnable of others before it)", flush=True)
    background = statistics.mean(others) if others else 0.0
    loaded = planner_for(sets, RANKS, "ppo", job, dataclasses.replace(hw, background=background))
    predicted = {}
    for name in names:
        placement = resolve(name, sets, RANKS, algo="ppo")
        predicted[name] = (placement, planner.price(*partition_of(placement)),
                           loaded.price(*partition_of(placement)))
    report(names, predicted, measured, background)


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def report(names, predicted, measured, background: float) -> None:
    print(f"\nseconds: generation / preparation / training = step; predicted alone: the machine to itself, "
          f"loaded: with {background:.1f} runnable processes of others (the runs' mean)")
    print(f"{'placement':<12}{'ranks':<28}{'predicted alone':<30}{'predicted loaded':<30}{'measured':<30}"
          f"{'busy':>6}{'CPU s':>7}  others")
    for name in names:
        placement, alone, loaded = predicted[name]
        ranks = " | ".join(f"{'+'.join(s.roles)} {len(placement[s.roles[0]])}" for s in alone.sets)
        line = f"{name:<12}{ranks:<28}{stages(alone.stage_times):<30}{stages(loaded.stage_times):<30}"
        rows = measured[name]
        if not rows:
            print(line + f"{'not run':<30}{busy_rank_seconds(alone):6.2f}")
            continue
        times = [median(rows, key) for _, key in PHASES]
        seen = [r["others"] for r in rows]
        print(line + f"{stages(times, median(rows, 'time/step_s')):<30}{busy_rank_seconds(alone):6.2f}"
              f"{median(rows, 'cpu_s'):7.2f}  {min(seen):.1f}-{max(seen):.1f}")
    ran = [n for n in names if measured[n]]
    orders = {"predicted alone": sorted(ran, key=lambda n: predicted[n][1].step_time),
              "predicted loaded": sorted(ran, key=lambda n: predicted[n][2].step_time),
              "measured": sorted(ran, key=lambda n: median(measured[n], "time/step_s")),
              "busy rank-s": sorted(ran, key=lambda n: busy_rank_seconds(predicted[n][1])),
              "measured CPU s": sorted(ran, key=lambda n: median(measured[n], "cpu_s"))}
    for label, order in orders.items():
        print(f"  {label + ':':<18}{' < '.join(order)}")
    def verdict(a, b):
        return "agree" if orders[a] == orders[b] else "DIFFER"

    print(f"  measured step vs predicted alone: {verdict('measured', 'predicted alone')}, vs predicted loaded: "
          f"{verdict('measured', 'predicted loaded')}; CPU-seconds vs busy rank-seconds: "
          f"{verdict('measured CPU s', 'busy rank-s')}")


def stages(times, step: float | None = None) -> str:
    return " / ".join(f"{t:.2f}" for t in times) + f" = {sum(times) if step is None else step:.2f}"


if __name__ == "__main__":
    main()
