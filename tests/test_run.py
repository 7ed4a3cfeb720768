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
