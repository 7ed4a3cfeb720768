"""hflow.run.Run's own bookkeeping, without workers: the bound on skipped optimizer steps."""
import pytest

from hflow.config import TrainerConfig
from hflow.metrics import LoggingConfig
from hflow.run import Run, RunStopped


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
