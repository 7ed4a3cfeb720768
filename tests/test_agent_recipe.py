"""recipes/agent.py end to end on CPU ranks: GRPO over multi-turn trajectories, held-out
evaluation with the tools, checkpoints and resume, a bad --agent.env refused at once, and the
environment's rewards kept as hflow.recipe_kit.scoring.Rewards keeps a rule's (samples.jsonl, the stop
after failed batches, the no-signal warning)."""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dist import PROGRAMS, torchrun
from test_agent_rollout import ending_turns_model
from test_recipes import TIMING
from test_reward_signal import rollout
from hflow.recipe_kit.config import RewardConfig
from hflow.default.model import build_default
from hflow.recipe_kit.scoring import Rewards, ScoringFailed

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agent.py")
ENVS = os.path.join(PROGRAMS, "agent_envs.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory, tiny_model):
    """The tiny model ending most turns within a few tokens (one turn per trajectory otherwise)."""
    return ending_turns_model(tiny_model, tmp_path_factory.mktemp("eot") / "model")


def small_run(model, out, steps, *extra):
    return ["--model.path", model, "--trainer.output-dir", out, "--trainer.steps", steps,
            "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 4,
            "--trainer.eval-size", 8, "--trainer.logging.no-progress-bars", "--trainer.no-export", *extra]


def rows(out, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (Path(out) / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def scored_envs(tmp_path_factory) -> str:
    """A file of environments whose rewards a test can tell from outside: --agent.env <it>:Class."""
    path = tmp_path_factory.mktemp("envs") / "scored_envs.py"
    path.write_text(textwrap.dedent('''
        from hflow.agents import Environment, StepResult

        class FirstDigit(Environment):
            """One turn, rewarded with the prompt's first digit: a samples.jsonl row's score is
            known from its prompt, and the prompts' scores differ."""
            def reset(self, row):
                self.reward = float(next(c for c in row["prompt"] if c.isdigit()))
                return row["prompt"]

            def step(self, text):
                return StepResult(None, reward=self.reward, done=True)

        class Broken(Environment):
            def reset(self, row):
                return row["prompt"]

            def step(self, text):
                raise RuntimeError("the environment is broken")
    '''))
    return str(path)


@pytest.mark.dist
def test_agent_recipe_with_the_calculator_logs_agent_metrics_and_evaluates_with_tools(tiny_model, tmp_path):
    out = tmp_path / "calc"
    torchrun(RECIPE, 2, small_run(tiny_model, out, 2, "--agent.env", "calculator", "--agent.reward", "sum"), timeout=400).check()
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    for row in (logged[0], logged[-1]):   # before training and at the end, on the held-out prompts
        assert "eval/reward_mean" in row and row["eval/agent/turns"] >= 1, row
    for key in ("reward/mean", "reward/text_mean", "actor/loss", "response_length/mean", "agent/turns",
                "agent/model_tokens", "agent/observation_tokens", "agent/tool_calls", "agent/failed",
                "agent/trajectory_reward", "time/generate_s"):
        assert key in logged[1], key
    assert sum(v for k, v in logged[1].items() if k.startswith("agent/finish/")) == pytest.approx(1.0)


@pytest.mark.dist
def test_agent_recipe_multi_turn_run_resumes_as_the_uninterrupted_one(eot_model, tmp_path):
    """Three turns per trajectory (two observations the model reads, not trained on), the
    environment's reward; saved every step, resumed for one more: the resumed step equals the
    uninterrupted run's (each step's trajectories are seeded by the step)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--agent.env", f"{ENVS}:ThreeTurns", "--agent.reward", "env", "--rollout.max-tokens", 96)
    torchrun(RECIPE, 2, small_run(eot_model, straight, 3, *common), timeout=400).check()
    torchrun(RECIPE, 2, small_run(eot_model, resumed, 2, "--trainer.save-every", 1, *common), timeout=400).check()
    assert (resumed / "checkpoints" / "step_2").is_dir()
    again = torchrun(RECIPE, 2, small_run(eot_model, resumed, 3, "--trainer.resume", *common), timeout=400).check()
    assert "resumed from step 2" in again.output, again.output
    a, b = rows(straight), rows(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    row = a[1]
    assert row["agent/turns"] > 1 and row["agent/observation_tokens"] > 0, row
    assert row["actor/grad_norm"] > 0, row   # the trajectories' rewards differ: something is learned
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING)}   # noqa: E731
    assert strip(a[3]) == strip(b[3])


@pytest.mark.dist
@pytest.mark.parametrize("args, expected", [
    (["--agent.env", "calculater"], "--agent.env calculater: not a built-in environment (calculator, calculator_hermes, no_tools, multi_question)"),
    (["--agent.env", "no_such_module_here:Env"],
     "--agent.env no_such_module_here:Env: cannot import module 'no_such_module_here'"),
    (["--agent.max-turns", "0"], "--agent.max-turns 0: must be >= 1 (model turns per trajectory)"),
], ids=["misspelt built-in", "missing module", "no turns"])
def test_bad_agent_flags_are_refused_with_one_line_before_anything_loads(args, expected, tiny_model, tmp_path):
    out = tmp_path / "out"
    run = torchrun(RECIPE, 2, small_run(tiny_model, out, 2, *args), timeout=200)
    assert not run.timed_out, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], run.output
    assert re.search(r"exitcode\s*:\s*2\b", run.output), run.output   # rank 0's status: a flag error
    assert not (out / "metrics.jsonl").exists()


def test_agent_recipe_help_lists_the_agent_and_algo_flags():
    run = subprocess.run([sys.executable, RECIPE, "--help"], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"COLUMNS": "100"})
    assert run.returncode == 0, run.stderr
    for flag in ("--agent.env", "--agent.reward", "--agent.max-turns", "--agent.tool-timeout-s",
                 "--algo.estimator", "--algo.loss", "--rollout.max-tokens"):
        assert flag in run.stdout, flag


@pytest.mark.dist
@pytest.mark.parametrize("algo", [
    ("--algo.estimator", "grpo", "--algo.kl-coef", 0.01, "--actor.epochs", 2),   # KL in the loss, off-policy
    ("--algo.estimator", "reinforce_pp", "--algo.loss", "gspo", "--algo.kl-coef", 0.01),   # KL in the reward
], ids=["grpo kl loss 2 epochs", "reinforce_pp gspo kl reward"])
def test_agent_recipe_with_a_reference_over_multi_turn_trajectories(algo, eot_model, tmp_path):
    """The reference's log-probs and the KL over streams with observations in them; with two
    epochs, the engine's log-probs of the model's tokens as the old ones (fp32)."""
    out = tmp_path / "kl"
    torchrun(RECIPE, 2, small_run(eot_model, out, 2, "--agent.env", f"{ENVS}:ThreeTurns", "--agent.reward", "env",
                                  "--rollout.max-tokens", 96, *algo), timeout=400).check()
    first, row = rows(out)[1:]
    # step 1 samples with the reference's own weights: the engine's log-probs of the model's tokens are
    # the reference's (observations in between); after an update they are not
    assert abs(first["kl/mean"]) < 1e-4 and row["kl/mean"] != 0 and row["agent/observation_tokens"] > 0, row
    assert ("actor/kl_loss" in row) == (algo[1] == "grpo"), row
    assert 0 <= row["actor/clipfrac"] <= 1 and row["actor/grad_norm"] > 0, row


@pytest.mark.dist
def test_environment_rewards_are_written_to_samples_jsonl_with_their_scores(eot_model, scored_envs, tmp_path):
    """--agent.reward env: the trajectories and their environment rewards in samples.jsonl, as
    grpo.py writes its responses' scores (one trajectory per prompt here, so every one shows)."""
    out = tmp_path / "samples"
    run = torchrun(RECIPE, 2, small_run(eot_model, out, 2, "--agent.env", f"{scored_envs}:FirstDigit",
                                        "--agent.reward", "env", "--rollout.max-tokens", 96, "--data.batch-size", 2,
                                        "--rollout.n", 1, "--trainer.logging.samples-every", 1), timeout=400).check()
    logged, samples = rows(out), rows(out, "samples.jsonl")
    assert all(r["agent/finish/done"] == 1.0 for r in logged[1:]), logged   # every trajectory got its reward
    assert [r["step"] for r in samples] == [1, 1, 2, 2], samples   # the 2 trajectories of each step
    for row in samples:
        assert set(row) == {"step", "prompt", "response", "score"}, row
        assert row["score"] == float(re.search(r"\d", row["prompt"]).group()), row
    for step in (1, 2):   # the rows are the step's trajectories: their scores make its reward/mean
        assert sum(r["score"] for r in samples if r["step"] == step) / 2 == logged[step]["reward/mean"]
    assert "warning: every response scored" not in run.output


@pytest.mark.dist
def test_an_environment_that_fails_every_trajectory_stops_the_run_with_one_message(eot_model, scored_envs, tmp_path):
    out = tmp_path / "broken"
    run = torchrun(RECIPE, 2, small_run(eot_model, out, 10, "--agent.env", f"{scored_envs}:Broken",
                                        "--agent.reward", "env", "--rollout.max-tokens", 96), timeout=400)
    assert run.returncode == 1 and not run.timed_out, run.output
    message = ("error: the environment failed on every trajectory of 3 batches in a row (8 of 8 in the last; "
               "first: env_error: RuntimeError: the environment is broken); fix --agent.env ")
    assert run.output.count(message) == 1, run.output
    assert [r["step"] for r in rows(out)] == [0, 1, 2]   # steps 1 and 2 logged, step 3 stopped the run


def test_known_scores_are_kept_as_the_rules_are(tmp_path, capsys):
    """Rewards.record (an environment's scores): the samples carry them, the no-signal warning
    comes after three alike batches, and batches whose every row failed stop the run."""
    tokenizer = AutoTokenizer.from_pretrained(build_default(tmp_path / "m", "tiny"))
    rewards = Rewards(None, RewardConfig(max_failed_batches=3), tokenizer)
    batch = rollout(tokenizer, ["5", "7"], [42, 42])
    rewards.record(batch, torch.tensor([0.5, 0.25]), [None, None])
    assert [(r["response"], r["score"]) for r in rewards.samples] == [("5", 0.5), ("7", 0.25)]
    alike = Rewards(None, RewardConfig(), tokenizer)
    for _ in range(3):
        alike.record(batch, torch.tensor([1.0, 1.0]), [None, None])
    assert capsys.readouterr().out.count("warning: every response scored 1 in each of the first 3 batches") == 1
    failures = ["env_error: boom", "tool_timeout: no answer within 10s"]
    for _ in range(2):
        rewards.record(batch, torch.zeros(2), failures, culprit="the environment", unit="trajectory", fix="fix it")
    with pytest.raises(ScoringFailed, match=r"^the environment failed on every trajectory of 3 batches in a row "
                                            r"\(2 of 2 in the last; first: env_error: boom\); fix it, or raise"):
        rewards.record(batch, torch.zeros(2), failures, culprit="the environment", unit="trajectory", fix="fix it")
    assert "warning" not in capsys.readouterr().out   # every score failed: that is the message
    rewards.close()
    alike.close()


def test_held_out_evaluation_takes_how_to_respond_and_averages_each_batchs_figures_over_the_prompts():
    """hflow.recipe_kit.evaluation.evaluate with the agent recipe's seams: `respond` makes and
    scores the responses (greedy, one per prompt), `batch_figures` are averaged over the prompts,
    a short last batch weighing by its rows."""
    from hflow.batch import Batch
    from hflow.data.loading import PromptDataset
    from hflow.recipe_kit.evaluation import evaluate
    from hflow.workers import RolloutConfig

    val = PromptDataset(prompt_ids=[[i] for i in range(10)], prompts=[str(i) for i in range(10)],
                        ground_truths=[None] * 10, extras=[{}] * 10)
    temperatures = []

    def respond(rows, cfg):   # scores the prompt's number; a batch's figure is its size
        temperatures.append((cfg.n, cfg.temperature))
        return Batch({"size": [len(rows)] * len(rows)}), sum(float(p.prompt) for p in rows)

    metrics = evaluate(None, val, None, None, RolloutConfig(n=8, temperature=1.0), size=7, batch_size=3,
                       sampled=False, respond=respond, batch_figures=lambda b: {"eval/agent/size": b["size"][0]})
    assert temperatures == [(1, 0.0)] * 3   # batches of 3, 3 and 1, greedy
    assert metrics == {"eval/reward_mean": sum(range(7)) / 7, "eval/agent/size": (3 * 3 + 3 * 3 + 1 * 1) / 7}
