"""recipes/agent.py --agent.credit turn end to end on 2 CPU ranks: per-turn rewards credited turn by
turn, on an environment whose turns' rewards differ (something is learned) and on the built-in
multi_question task."""
import json
import textwrap
from pathlib import Path

import pytest

from dist import torchrun
from test_agent_rollout import ending_turns_model
from hflow.default.model import build_default

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agent.py")


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("turn_credit_model")
    return ending_turns_model(build_default(root / "base", "tiny", seed=0), root / "eot")


@pytest.fixture(scope="module")
def parity_env(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("envs") / "turn_envs.py"
    path.write_text(textwrap.dedent('''
        from hflow.agents import Environment, StepResult

        class TurnParity(Environment):
            """Three turns, each rewarded with the parity of its own text's length: a prompt's
            trajectories differ turn by turn, so per-turn advantages are not all 0."""
            def reset(self, row):
                self.left = 3
                return row["prompt"]

            def step(self, text):
                self.left -= 1
                return StepResult(None if self.left == 0 else " next", reward=float(len(text) % 2),
                                  done=self.left == 0)
    '''))
    return f"{path}:TurnParity"


@pytest.mark.dist
@pytest.mark.parametrize("env", ["parity", "multi_question"])
def test_turn_credit_runs_end_to_end(env, eot_model, parity_env, tmp_path):
    out = tmp_path / "out"
    spec = parity_env if env == "parity" else "multi_question"
    args = ["--model.path", eot_model, "--trainer.output-dir", out, "--trainer.steps", 2, "--data.task", "arithmetic",
            "--data.batch-size", 4, "--rollout.n", 4, "--rollout.max-tokens", 48, "--agent.max-turn-tokens", 6,
            "--trainer.eval-size", 8, "--trainer.logging.no-progress-bars", "--trainer.no-export",
            "--agent.env", spec, "--agent.reward", "env", "--agent.credit", "turn", "--agent.turn-discount", 0.5,
            "--agent.episode-weight", 0.5]
    torchrun(RECIPE, 2, args, timeout=400).check()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    step = rows[1]
    assert "reward/turn_0" in step and step["agent/turns"] > 1, step
    if env == "parity":   # the turns' rewards differ within a prompt's group: advantages, a gradient
        assert "reward/turn_1" in step and step["actor/grad_norm"] > 0, step
