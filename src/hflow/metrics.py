"""Metrics: one console line per step, `<output_dir>/metrics.jsonl`, optional TensorBoard / wandb.

    timer = Timer()
    with MetricsLogger(cfg.trainer.output_dir, cfg.trainer.logging, total_steps=100,
                       resume_step=resumed_step) as logger:
        for step in ...:
            with timer("generate"):
                ...
            logger.log(step, stats | timer.pop())    # {"time/generate_s": 1.2, ...}

Everything here runs on the controller (rank 0). `progress()` is the one piece meant for
workers too: a progress bar for long phases (generation, update) shown by one rank.

metrics.jsonl holds one JSON object per `log` call: `{"step": 3, "reward/mean": 0.41, ...}`,
every value a float, each line flushed as it is written. On resume from step N the rows with
step > N (written after the checkpoint the run resumes from) are dropped, so the file never
holds a step twice.
"""
import json
import math
import numbers
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"

# Shown on the console line, in this order, when present; everything goes to metrics.jsonl.
DEFAULT_CONSOLE_KEYS = (
    "reward/mean", "eval/reward_mean", "kl/mean", "actor/loss", "critic/loss", "actor/grad_norm",
    "response_length/mean", "time/step_s", "throughput/tokens_per_s",
)


@dataclass
class LoggingConfig:
    """Where metrics go besides the console and <output_dir>/metrics.jsonl."""

    tensorboard: bool = False
    """also write TensorBoard event files to <output_dir>/tensorboard (needs `pip install tensorboard`)"""
    wandb: bool = False
    """also log to Weights & Biases (needs `pip install wandb` and a login)"""
    wandb_project: str = "hflow"
    """wandb project name"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb picks one)"""
    console_keys: tuple[str, ...] = DEFAULT_CONSOLE_KEYS
    """metrics shown on each step's console line, when present"""
    progress_bars: bool = True
    """show progress bars for long phases (generation, update)"""
    samples_every: int = 50
    """print a few of the step's prompts, responses and scores, and add them to <output_dir>/samples.jsonl, at the first step and every this many steps (0: never)"""


def to_float(value) -> float:
    """A Python float from a number, a bool, a one-element tensor or a numpy scalar."""
    if hasattr(value, "item"):           # torch.Tensor, numpy scalar / 0-d array
        value = value.item()
    if isinstance(value, numbers.Number):
        return float(value)
    raise TypeError(f"metric values must be numbers, got {type(value).__name__}: {value!r}")


def format_line(step: int, metrics: dict, keys=DEFAULT_CONSOLE_KEYS, total_steps: int | None = None) -> str:
    """`step 3/100 | reward/mean 0.41 | kl/mean 0.0012 | ...` with 4 significant digits."""
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    parts = [f"{key} {metrics[key]:.4g}" for key in keys if key in metrics]
    return " | ".join([head, *parts])


def read_metrics(path) -> list[dict]:
    """The rows of a metrics.jsonl (a path to the file or to the output directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _missing(package: str, flag: str) -> RuntimeError:
    return RuntimeError(f"{flag} needs the `{package}` package, which is not installed: "
                        f"run `pip install {package}`, or drop {flag}.")


class MetricsLogger:
    """Appends one row per step to metrics.jsonl, prints it, and forwards it to TB / wandb.

    `resume_step`: the step the run resumes from (rows after it are dropped); None starts a new
    file. `run_config`: the run's configuration (a dict), given to wandb and to TensorBoard as text.
    """

    def __init__(self, output_dir, config: LoggingConfig | None = None, total_steps: int | None = None,
                 resume_step: int | None = None, run_config: dict | None = None, stream=None):
        self.config = config or LoggingConfig()
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")
        # Optional sinks: imported only when asked for, with an error that says what to do.
        self._tb = self._open_tensorboard(resume_step, run_config) if self.config.tensorboard else None
        self._wandb = self._open_wandb(resume_step, run_config) if self.config.wandb else None

    def _truncate_after(self, step: int):
        rows = [r for r in read_metrics(self.path) if r.get("step", -1) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, self.path)          # atomic: a crash here leaves the old file whole

    def _open_tensorboard(self, resume_step, run_config):
        try:
            from torch.utils.tensorboard import SummaryWriter   # optional: --trainer.logging.tensorboard
        except ImportError as e:
            raise _missing("tensorboard", "--trainer.logging.tensorboard") from e
        # purge_step drops events the crashed run wrote after the checkpoint it resumes from.
        purge = None if resume_step is None else resume_step + 1
        writer = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=purge)
        if run_config is not None:   # TensorBoard's text tab renders markdown: the flags as a code block
            writer.add_text("config", "```\n" + json.dumps(run_config, indent=1, default=str) + "\n```")
        return writer

    def _open_wandb(self, resume_step, run_config):
        try:
            import wandb   # optional: --trainer.logging.wandb
        except ImportError as e:
            raise _missing("wandb", "--trainer.logging.wandb") from e
        # Keep the run id next to the metrics so that a resumed run continues the same wandb run.
        id_file = self.dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        run = wandb.init(project=self.config.wandb_project, name=self.config.wandb_run_name,
                         config=run_config, dir=str(self.dir), id=run_id,
                         resume="allow" if run_id else None)
        id_file.write_text(run.id)
        return run

    def log(self, step: int, metrics: dict) -> dict:
        """Write one row for `step`; returns the row's metrics as floats (None values: skipped)."""
        row = {key: to_float(value) for key, value in metrics.items()
               if key != "step" and value is not None}
        self._file.write(json.dumps({"step": int(step), **row}) + "\n")
        self._file.flush()
        print(format_line(step, row, self.config.console_keys, self.total_steps),
              file=self.stream, flush=True)
        if self._tb is not None:
            for key, value in row.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        return row

    def close(self):
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Timer:
    """Wall-clock seconds per phase, summed until popped as `time/<name>_s` metrics.

        timer = Timer()
        with timer("generate"): ...
        with timer("update"): ...
        timer.pop()   # {"time/generate_s": 1.2, "time/update_s": 0.7}; starts afresh
    """

    def __init__(self):
        self._seconds = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"time/{name}_s": seconds for name, seconds in self._seconds.items()}
        self._seconds.clear()
        return out


def progress_enabled() -> bool:
    """Progress bars show on global rank 0 only, unless HFLOW_PROGRESS=0 turns them off."""
    return os.environ.get("HFLOW_PROGRESS", "1") != "0" and os.environ.get("RANK", "0") == "0"


def progress(iterable=None, total: int | None = None, desc: str = "", enabled: bool | None = None,
             unit: str = "it"):
    """A progress bar (tqdm, which transformers already depends on) for a long phase.

    Use as `for x in progress(xs, desc="update")` or `bar = progress(total=n, desc="generate");
    bar.update(k); bar.close()`. `enabled=None` means `progress_enabled()`. The bar is removed
    when done (the step's console line is the record); off a terminal it redraws every 10 s
    instead of every 0.1 s so that log files stay short.
    """
    stream = sys.stderr
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=stream,
                disable=not (progress_enabled() if enabled is None else enabled),
                mininterval=0.1 if stream.isatty() else 10.0, dynamic_ncols=True)
