"""Draw a run's curves (reward and held-out eval, KL, response length, the actor's and the
critic's losses, the critic's explained variance, grad norms, reward-function failures) from
metrics.jsonl files to a PNG titled with the runs' names; panels with nothing logged (e.g. KL
without a reference model) are left out, and the failures panel when nothing failed.

    python scripts/plot_metrics.py --runs outputs/ppo                # -> outputs/ppo/metrics.png
    python scripts/plot_metrics.py --runs outputs/ppo outputs/grpo --out compare.png

A run is an output directory or a metrics.jsonl file. Needs matplotlib (`pip install matplotlib`).
"""
from dataclasses import dataclass
from pathlib import Path

import tyro

from hflow.metrics import METRICS_FILE, read_metrics

# panel title -> metrics drawn in it (solid line, then dashed, ...); eval rows are sparse, so
# every series is drawn only at the steps that carry it.
PANELS = {
    "reward": ("reward/mean", "eval/reward_mean", "eval/reward_mean_sampled"),
    "KL": ("kl/mean",),
    "response length": ("response_length/mean",),
    # apart: a critic's loss is orders of magnitude above the actor's, which would be a flat line
    "actor loss": ("actor/loss",),
    "critic loss": ("critic/loss", "cost_critic/loss"),
    "critic explained variance": ("critic/vf_explained_var",),
    "grad norm": ("actor/grad_norm", "critic/grad_norm"),
    "reward failures": ("reward/errors", "reward/timeouts", "reward/crashes"),
}
# panels drawn only when some value is not 0: a panel of zeros says nothing failed, at length
ONLY_WHEN_NONZERO = {"reward failures"}


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry `key`."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [s for s, _ in points], [v for _, v in points]


def plot(runs: list[Path], out: Path, panels: dict = PANELS):
    """Draw every panel for every run; returns the matplotlib Figure (also saved to `out`)."""
    try:
        from matplotlib.figure import Figure      # no pyplot: no GUI backend, works headless
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise SystemExit("plot_metrics.py needs matplotlib: run `pip install matplotlib` "
                         "(or `pip install hflow[plot]`).") from e
    loaded = dict(zip(run_labels(runs), (read_metrics(path) for path in runs)))
    drawn = {title: keys for title, keys in panels.items()
             if any(key in row and (row[key] != 0 or title not in ONLY_WHEN_NONZERO)
                    for rows in loaded.values() for row in rows for key in keys)}
    columns = 2 if len(drawn) > 1 else 1
    fig = Figure(figsize=(11, 3.5 * -(-len(drawn) // columns)), layout="constrained")
    axes = fig.subplots(-(-len(drawn) // columns), columns, squeeze=False).flatten()
    for ax in axes[len(drawn):]:
        ax.remove()
    fig.suptitle(" vs ".join(loaded))   # which run(s): a PNG is often looked at far from its directory
    for ax, (title, keys) in zip(axes, drawn.items()):
        for label, rows in loaded.items():
            for style, key in zip(("-", "--", ":", "-."), keys):
                steps, values = series(rows, key)
                if steps:
                    name = key if len(loaded) == 1 else f"{label}: {key}"
                    ax.plot(steps, values, style, marker="o" if len(steps) < 20 else None,
                            markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


def run_labels(runs: list[Path]) -> list[str]:
    """Each run's label: the shortest tail of its directory's path that tells it from the others
    (`a/out` and `b/out` are not both `out`); the same path given twice gets #2."""
    dirs = [Path(p).parent if Path(p).name == METRICS_FILE else Path(p) for p in runs]
    parts = [d.resolve().parts for d in dirs]
    labels = []
    for i, mine in enumerate(parts):
        others = {other for j, other in enumerate(parts) if j != i and other != mine}
        n = 1
        while n < len(mine) and any(other[-n:] == mine[-n:] for other in others):
            n += 1
        labels.append("/".join(mine[-n:]) or str(dirs[i]))
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label} #{seen[label]}"
    return labels


@dataclass
class Args:
    runs: tuple[Path, ...]
    """output directories or metrics.jsonl files (several: one curve per run)"""
    out: Path | None = None
    """PNG to write (default: metrics.png next to the first run's metrics.jsonl)"""


def main(args: Args) -> Path:
    first = Path(args.runs[0])
    out = args.out or (first.parent if first.name == METRICS_FILE else first) / "metrics.png"
    plot(list(args.runs), out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
