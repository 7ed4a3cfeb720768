"""A recipe's held-out curve over several seeds: the mean and spread docs/results.md reports.

    python scripts/seeds.py --recipe grpo --seeds 0 1 2                     # the default GRPO run
    python scripts/seeds.py --recipe ppo --seeds 0 1 2 -- --actor.optim.lr 3e-4   # flags after --
    python scripts/seeds.py --recipe ppo --name ppo-rm -- --reward.model default
    python scripts/seeds.py --recipe safe_rlhf --keys eval/answer_accuracy eval/refusal_rate cost/mean

Each seed s runs `torchrun --nproc-per-node --ranks recipes/<recipe>.py --data.seed s --rollout.seed s`
(the data order and the samples; the embedded default model and its warm-up stay the machine's,
cached) into --out/<name>/seed<s>, one after the other. Prints, for every step where it is logged,
the mean, the sample standard deviation, min and max over the seeds of each --keys metric
(eval/reward_mean: greedy held-out accuracy), the mean gain from the first such step, and the wall
time of each run with the machine's load average; writes the same to --out/<name>/summary.json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Config:
    recipe: str = "grpo"
    """recipes/<recipe>.py"""
    name: str | None = None
    """The runs' folder under --out (default: the recipe's name)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    out: str = "outputs/seeds"
    ranks: int = 2
    keys: list[str] = field(default_factory=lambda: ["eval/reward_mean"])
    """The metrics summarised at each step that logs them."""
    extra: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """Flags passed on to the recipe (after --)."""


def run(cfg: Config, seed: int) -> dict:
    out = Path(cfg.out) / (cfg.name or cfg.recipe) / f"seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.ranks),
               str(REPO / "recipes" / f"{cfg.recipe}.py"), "--data.seed", str(seed), "--rollout.seed", str(seed),
               "--trainer.output-dir", str(out), "--trainer.overwrite", "--trainer.logging.no-progress-bars",
               "--trainer.no-export", *cfg.extra]
    start, load = time.monotonic(), os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curves = {key: {row["step"]: row[key] for row in rows if key in row} for key in cfg.keys}
    return {"seed": seed, "curves": curves, "seconds": round(time.monotonic() - start), "load": round(load, 1),
            "end_load": round(os.getloadavg()[0], 1)}


def main(cfg: Config) -> None:
    runs = []
    for seed in cfg.seeds:
        runs.append(run(cfg, seed))
        r = runs[-1]
        for key, curve in r["curves"].items():
            print(f"seed {seed} {key}: " + " -> ".join(f"{v:.3f}" for v in curve.values()), flush=True)
        print(f"seed {seed}: {r['seconds']} s, load {r['load']} -> {r['end_load']}", flush=True)
    tables = {key: summarise([r["curves"][key] for r in runs], key) for key in cfg.keys}
    summary = {"recipe": cfg.recipe, "extra": cfg.extra, "seeds": cfg.seeds, "runs": runs, "tables": tables}
    (Path(cfg.out) / (cfg.name or cfg.recipe) / "summary.json").write_text(json.dumps(summary, indent=1))


def summarise(curves: list[dict], key: str) -> dict:
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    table = {}
    for step in steps:
        values = [c[step] for c in curves]
        gains = [c[step] - c[steps[0]] for c in curves]
        table[step] = t = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                           "min": min(values), "max": max(values), "gain_mean": statistics.mean(gains),
                           "gain_min": min(gains)}
        if step == steps[0] or step % 50 == 0 or step == steps[-1]:   # per-step metrics: every 50th
            print(f"{key} step {step:>4}: {t['mean']:.3f} ± {t['std']:.3f} (min {t['min']:.3f}, max {t['max']:.3f}); "
                  f"gain {t['gain_mean']:+.3f} (min {t['gain_min']:+.3f})", flush=True)
    return table


if __name__ == "__main__":
    main(tyro.cli(Config))
