"""A recipe's held-out curve over several seeds: the mean and spread the README reports.

    python scripts/seeds.py --recipe grpo --seeds 0 1 2                     # the default GRPO run
    python scripts/seeds.py --recipe ppo --seeds 0 1 2 -- --actor.optim.lr 3e-4   # flags after --

Each seed s runs `torchrun --nproc-per-node --ranks recipes/<recipe>.py --data.seed s --rollout.seed s`
(the data order and the samples; the embedded default model and its warm-up stay the machine's,
cached) into --out/<recipe>/seed<s>, one after the other. Prints, for every evaluated step, the
mean, the sample standard deviation, min and max of eval/reward_mean (greedy held-out accuracy)
over the seeds, the mean gain from step 0, and the wall time of each run with the machine's load
average; writes the same to --out/<recipe>/summary.json.
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
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    out: str = "outputs/seeds"
    ranks: int = 2
    key: str = "eval/reward_mean"
    """The metric summarised at each evaluated step."""
    extra: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """Flags passed on to the recipe (after --)."""


def run(cfg: Config, seed: int) -> dict:
    out = Path(cfg.out) / cfg.recipe / f"seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.ranks),
               str(REPO / "recipes" / f"{cfg.recipe}.py"), "--data.seed", str(seed), "--rollout.seed", str(seed),
               "--trainer.output-dir", str(out), "--trainer.overwrite", "--trainer.logging.no-progress-bars",
               "--trainer.no-export", *cfg.extra]
    start, load = time.monotonic(), os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = {row["step"]: row[cfg.key] for row in rows if cfg.key in row}
    return {"seed": seed, "curve": curve, "seconds": round(time.monotonic() - start), "load": round(load, 1),
            "end_load": round(os.getloadavg()[0], 1)}


def main(cfg: Config) -> None:
    runs = []
    for seed in cfg.seeds:
        runs.append(run(cfg, seed))
        r = runs[-1]
        print(f"seed {seed}: " + " -> ".join(f"{v:.3f}" for v in r["curve"].values())
              + f"  ({r['seconds']} s, load {r['load']} -> {r['end_load']})", flush=True)
    steps = sorted(set.intersection(*(set(r["curve"]) for r in runs)))
    table = {}
    for step in steps:
        values = [r["curve"][step] for r in runs]
        gains = [r["curve"][step] - r["curve"][steps[0]] for r in runs]
        table[step] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                       "min": min(values), "max": max(values), "gain_mean": statistics.mean(gains),
                       "gain_min": min(gains)}
        t = table[step]
        print(f"step {step:>4}: {t['mean']:.3f} ± {t['std']:.3f} (min {t['min']:.3f}, max {t['max']:.3f}); "
              f"gain {t['gain_mean']:+.3f} (min {t['gain_min']:+.3f})", flush=True)
    summary = {"recipe": cfg.recipe, "extra": cfg.extra, "seeds": cfg.seeds, "key": cfg.key, "runs": runs,
               "table": table}
    (Path(cfg.out) / cfg.recipe / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(tyro.cli(Config))
