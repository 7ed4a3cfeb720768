"""metrics.jsonl rows, console lines, resume without duplicate rows, Timer, optional sinks."""
import builtins
import importlib.util
import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hflow.metrics import LoggingConfig, MetricsLogger, Timer, format_line, progress, read_metrics


def _log_steps(logger, steps):
    for step in steps:
        logger.log(step, {"reward/mean": step / 10, "kl/mean": torch.tensor(step * 1e-3),
                          "actor/loss": np.float32(-0.5), "count": step, "ok": True})


def test_rows_are_flushed_floats_and_console_lines(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=3, stream=out)
    _log_steps(logger, [1, 2])
    # Readable while the logger is still open: every line is flushed as written.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.1, "kl/mean": pytest.approx(1e-3), "actor/loss": -0.5, "count": 1.0, "ok": 1.0},
        {"step": 2, "reward/mean": 0.2, "kl/mean": pytest.approx(2e-3), "actor/loss": -0.5, "count": 2.0, "ok": 1.0},
    ]
    row = read_metrics(tmp_path)[0]
    assert all(type(v) is float for k, v in row.items() if k != "step") and type(row["step"]) is int
    logger.close()
    console = out.getvalue().splitlines()
    assert console[0] == "step 1/3 | reward/mean 0.1 | kl/mean 0.001 | actor/loss -0.5"


def test_bad_values_are_refused_and_none_is_skipped(tmp_path):
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        with pytest.raises(TypeError, match="must be numbers.*str"):
            logger.log(1, {"reward/mean": "high"})
        logger.log(1, {"reward/mean": 1, "critic/loss": None, "x": float("nan")})
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row.keys() == {"step", "reward/mean", "x"} and math.isnan(row["x"])


def test_resume_drops_rows_after_the_checkpoint_and_appends(tmp_path):
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        _log_steps(logger, range(0, 6))           # crashed after logging step 5
    with MetricsLogger(tmp_path, resume_step=3, stream=io.StringIO()) as logger:
        _log_steps(logger, range(4, 8))           # resumed from the step-3 checkpoint
    steps = [row["step"] for row in read_metrics(tmp_path)]
    assert steps == list(range(0, 8))
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:   # a new run starts afresh
        _log_steps(logger, [1])
    assert [row["step"] for row in read_metrics(tmp_path)] == [1]


def test_timer_sums_phases_until_popped():
    timer = Timer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.05)
    with pytest.raises(ZeroDivisionError):
        with timer("update"):
            1 / 0                                  # time still counted when the phase fails
    first = timer.pop()
    assert first.keys() == {"time/generate_s", "time/update_s"}
    assert 0.1 <= first["time/generate_s"] < 1.0 and first["time/update_s"] < 0.1
    assert timer.pop() == {}


def test_format_line_keeps_the_configured_order():
    line = format_line(7, {"b": 2.0, "a": 1.23456, "c": 3.0}, keys=("a", "b", "missing"))
    assert line == "step 7 | a 1.235 | b 2"


def test_progress_bar_counts_and_is_off_on_other_ranks(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert list(progress(range(3), desc="update")) == [0, 1, 2]
    assert progress(total=3).disable
    monkeypatch.setenv("RANK", "0")
    bar = progress(total=4, desc="generate")
    bar.update(4)
    assert bar.n == 4 and not bar.disable
    bar.close()
    monkeypatch.setenv("HFLOW_PROGRESS", "0")
    assert progress(total=3).disable


@pytest.mark.parametrize("sink,package", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_optional_sink_says_what_to_install(tmp_path, monkeypatch, sink, package):
    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(RuntimeError, match=f"pip install {sink}.*--trainer.logging.{sink}"):
        MetricsLogger(tmp_path, LoggingConfig(**{sink: True}))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_events_match_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), stream=io.StringIO()) as logger:
        _log_steps(logger, range(0, 4))
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), resume_step=1,
                       stream=io.StringIO()) as logger:
        _log_steps(logger, range(2, 5))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [0, 1, 2, 3, 4]      # purge_step removed the old 2, 3
    assert [e.value for e in scalars] == pytest.approx([r["reward/mean"] for r in read_metrics(tmp_path)])


# ---------------------------------------------------------------- scripts/plot_metrics.py

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_metrics.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(path, with_critic=True):
    with MetricsLogger(path, stream=io.StringIO()) as logger:
        logger.log(0, {"eval/reward_mean": 0.2})
        for step in range(1, 6):
            row = {"reward/mean": 0.1 * step, "kl/mean": 0.01 * step, "response_length/mean": 4 + step,
                   "actor/loss": -0.05 * step}
            if with_critic:
                row["critic/loss"] = 1.0 / step
            if step == 5:
                row["eval/reward_mean"] = 0.6
            logger.log(step, row)


def test_plot_draws_the_logged_values(tmp_path):
    pytest.importorskip("matplotlib")
    plot_metrics = _load_script()
    _write_run(tmp_path / "ppo")
    out = plot_metrics.main(plot_metrics.Args(runs=(tmp_path / "ppo",)))
    assert out == tmp_path / "ppo" / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot_metrics.plot([tmp_path / "ppo" / "metrics.jsonl"], tmp_path / "again.png")
    reward, kl, length, actor_loss, critic_loss = fig.axes[:5]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in reward.lines}
    assert lines["eval/reward_mean"] == ([0, 5], [0.2, 0.6])
    assert lines["reward/mean"][0] == [1, 2, 3, 4, 5]
    assert list(kl.lines[0].get_ydata()) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    # the two losses on axes of their own: the critic's scale would flatten the actor's
    assert [line.get_label() for line in actor_loss.lines] == ["actor/loss"]
    assert [line.get_label() for line in critic_loss.lines] == ["critic/loss"]
    assert fig.get_suptitle() == "ppo"


def test_plot_compares_runs(tmp_path):
    pytest.importorskip("matplotlib")
    plot_metrics = _load_script()
    _write_run(tmp_path / "ppo")
    _write_run(tmp_path / "grpo", with_critic=False)
    fig = plot_metrics.plot([tmp_path / "ppo", tmp_path / "grpo"], tmp_path / "cmp.png")
    assert [line.get_label() for line in fig.axes[3].lines] == ["ppo: actor/loss", "grpo: actor/loss"]
    assert [line.get_label() for line in fig.axes[4].lines] == ["ppo: critic/loss"]
    assert fig.get_suptitle() == "ppo vs grpo"
    assert (tmp_path / "cmp.png").exists()


def test_runs_in_directories_of_the_same_name_get_labels_that_tell_them_apart(tmp_path):
    plot_metrics = _load_script()
    a, b = tmp_path / "lr1e-4" / "out", tmp_path / "lr1e-5" / "out"
    assert plot_metrics.run_labels([a, b / "metrics.jsonl"]) == ["lr1e-4/out", "lr1e-5/out"]
    assert plot_metrics.run_labels([tmp_path / "ppo", tmp_path / "grpo"]) == ["ppo", "grpo"]
    assert plot_metrics.run_labels([a, a]) == ["out", "out #2"]


def test_plot_draws_two_out_directories_as_two_runs_with_grad_norms_and_reward_failures(tmp_path):
    pytest.importorskip("matplotlib")
    plot_metrics = _load_script()
    for name in ("a", "b"):
        with MetricsLogger(tmp_path / name / "out", stream=io.StringIO()) as logger:
            for step in range(1, 4):
                logger.log(step, {"reward/mean": 0.1 * step, "actor/grad_norm": 1.0 / step,
                                  "reward/errors": float(step == 2), "eval/reward_mean_sampled": 0.3})
    fig = plot_metrics.plot([tmp_path / "a" / "out", tmp_path / "b" / "out"], tmp_path / "x.png")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["reward", "grad norm", "reward failures"]   # nothing logged: no KL/length/loss panel
    reward = {line.get_label() for line in fig.axes[0].lines}
    assert reward == {"a/out: reward/mean", "a/out: eval/reward_mean_sampled",
                      "b/out: reward/mean", "b/out: eval/reward_mean_sampled"}
    assert [list(line.get_ydata()) for line in fig.axes[2].lines] == [[0, 1, 0], [0, 1, 0]]
    # nothing failed: no panel of zeros
    with MetricsLogger(tmp_path / "clean", stream=io.StringIO()) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward/mean": 0.1 * step, "reward/errors": 0.0, "reward/timeouts": 0.0})
    assert [ax.get_title() for ax in plot_metrics.plot([tmp_path / "clean"], tmp_path / "y.png").axes] == ["reward"]


def test_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    plot_metrics = _load_script()
    _write_run(tmp_path / "run")
    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot_metrics.plot([tmp_path / "run"], tmp_path / "x.png")
