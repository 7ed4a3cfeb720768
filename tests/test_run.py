"""hflow.recipe_kit.run.Run's own bookkeeping, without workers: the bound on skipped optimizer steps."""
import dataclasses
import json
from pathlib import Path

import pytest

from hflow.recipe_kit.config import TrainerConfig
from hflow.metrics import LoggingConfig
from hflow.recipe_kit.run import Run, RunStopped


def test_the_run_stops_once_more_steps_were_skipped_than_allowed(tmp_path):
    cfg = TrainerConfig(steps=10, output_dir=str(tmp_path), max_skipped_steps=2,
                        logging=LoggingConfig(progress_bars=False))
    run = Run(cfg, trained={})
    steps = run.steps()
    run.end_step(next(steps), {"actor/skipped_steps": 1.0, "critic/skipped_steps": 0.0})
    run.end_step(next(steps), {"actor/skipped_steps": 0.0})
    run.end_step(next(steps), {"critic/skipped_steps": 1.0})        # 2 so far: still allowed
    with pytest.raises(RunStopped, match="3 optimizer steps skipped .* --trainer.max-skipped-steps 2"):
        run.end_step(next(steps), {"actor/skipped_steps": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text().count('"step"') == 4   # the last step is logged too


def test_a_run_says_what_it_will_do_and_what_it_did(tmp_path, capsys):
    """One line before the first step and one after the last (issue 27.2)."""
    cfg = TrainerConfig(steps=3, output_dir=str(tmp_path), eval_every=2, eval_size=8, save_every=0,
                        logging=LoggingConfig(progress_bars=False))
    scores = iter([0.25, 0.5, 0.75])
    run = Run(cfg, trained={}, evaluate=lambda: {"eval/reward_mean": next(scores)}, about="12 prompts")
    for step in run.steps():
        run.end_step(step, {"reward/mean": 0.0})
    run.finish()
    out = capsys.readouterr().out
    assert (f"hflow: steps 1..3; held-out evaluation on 8 prompts every 2 steps and at the end; no checkpoints "
            f"(--trainer.save-every); output in {tmp_path}; 12 prompts") in out
    assert "hflow: done: step 3 of 3 in " in out and "held-out eval/reward_mean 0.250 -> 0.750" in out
    # the three evaluations: step 0, step 2 and the last
    assert [line.count("eval/") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 0, 1, 1]


def test_a_few_samples_are_shown_at_the_first_step_and_every_n(tmp_path, capsys):
    """Prompts, responses and scores on the console and in samples.jsonl (issue 27.3)."""
    import json
    cfg = TrainerConfig(steps=5, output_dir=str(tmp_path), logging=LoggingConfig(progress_bars=False, samples_every=2))
    rows = [{"prompt": "12+3=", "response": "15", "score": 1.0}, {"prompt": "x" * 200, "response": "", "score": 0.0}]
    run = Run(cfg, trained={}, samples=lambda: rows)
    for step in run.steps():
        run.end_step(step, {"reward/mean": 0.5})
    out = capsys.readouterr().out
    assert out.count("samples (prompt -> response: score)") == 3   # steps 1, 2 and 4
    assert "'12+3=' -> '15': 1" in out and "x" * 117 + "...' -> ''" in out   # long prompts clipped on the console
    saved = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saved] == [1, 1, 2, 2, 4, 4] and saved[1]["prompt"] == "x" * 200


def test_the_first_line_counts_the_held_out_prompts_there_are(tmp_path, capsys):
    """A held-out file of 104 prompts under --trainer.eval-size 500 is 104 prompts, and a run with
    no held-out split at all says so and evaluates nothing (issue 42: both said 500)."""
    cfg = TrainerConfig(steps=1, output_dir=str(tmp_path), eval_size=500, logging=LoggingConfig(progress_bars=False))
    calls = []
    run = Run(cfg, trained={}, evaluate=lambda: calls.append(1) or {"eval/reward_mean": 0.5}, eval_prompts=104)
    assert "held-out evaluation on 104 prompts at the start and the end" in capsys.readouterr().out
    cfg = dataclasses.replace(cfg, output_dir=str(tmp_path / "none"))
    run = Run(cfg, trained={}, evaluate=lambda: calls.append(1) or {}, eval_prompts=0)
    assert "no held-out evaluation" in capsys.readouterr().out
    for step in run.steps():
        run.end_step(step, {"reward/mean": 0.0})
    run.finish()
    assert not calls


def test_the_runs_resolved_flags_are_written_beside_its_metrics_and_handed_to_tensorboard(tmp_path):
    """config.json holds the run's flags as they resolved; TensorBoard gets them as text; a
    resumed run with other flags writes its own (it runs under them)."""
    cfg = TrainerConfig(steps=1, output_dir=str(tmp_path), logging=LoggingConfig(progress_bars=False))
    config = {"actor": {"optim": {"lr": 1e-5}}, "rollout": {"temperature": 0.7}, "model": {"path": Path("/m")}}
    run = Run(cfg, trained={}, run_config=config)
    for step in run.steps():
        run.end_step(step, {"reward/mean": 0.0})
    run.finish()
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == {"actor": {"optim": {"lr": 1e-5}}, "rollout": {"temperature": 0.7}, "model": {"path": "/m"}}
    Run(cfg, trained={}, run_config={"actor": {"optim": {"lr": 3e-5}}}).finish()
    assert json.loads((tmp_path / "config.json").read_text()) == {"actor": {"optim": {"lr": 3e-5}}}

    pytest.importorskip("tensorboard", reason="TensorBoard is an optional package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = dataclasses.replace(cfg, output_dir=str(tmp_path / "tb"),
                                logging=LoggingConfig(progress_bars=False, tensorboard=True))
    Run(board, trained={}, run_config=config).finish()
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 1e-05' in text and '"temperature": 0.7' in text
