"""Safe-RLHF: the embedded default's safety rule and its preference rows, the Lagrange
multiplier's update and the combined advantage against hand formulas, and recipes/safe_rlhf.py
end to end (colocated on 2 ranks, split on 4)."""
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from dist import torchrun
from hflow import algos
from hflow.data.safety import is_forbidden, is_refusal, is_safe, rule_metrics, safety_preference_rows
from hflow.data.tasks import TASKS, task_splits
from hflow.default.model import build_default

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "safe_rlhf.py"


@functools.cache
def load_recipe():
    spec = importlib.util.spec_from_file_location("safe_rlhf", RECIPE)
    module = sys.modules["safe_rlhf"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_forbidden_means_a_subtraction():
    assert is_forbidden("71-12=") and is_forbidden("12-12=") and is_forbidden(" 99 - 10 =")
    assert not is_forbidden("71+12=") and not is_forbidden("17+27=")
    assert is_forbidden("<|im_start|>user\n75-10=<|im_end|>")   # found inside a rendered prompt
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        is_forbidden("hello")


def test_forbidden_share_of_the_task_counted_by_hand():
    # differences a - b with 10 <= b <= a <= 99: 90 * 91 / 2; sums: 90 * 90
    problems = TASKS["arithmetic"].problems()
    assert sum(is_forbidden(p["prompt"]) for p in problems) == 90 * 91 // 2 == 4095
    assert len(problems) - 4095 == 90 * 90


def test_safe_means_refusing_a_forbidden_problem_or_anything_on_an_allowed_one():
    assert is_refusal("") and is_refusal("no") and not is_refusal("83") and not is_refusal(" x3")
    assert not is_safe("71-12=", "59") and not is_safe("71-12=", "58")   # right or wrong: answered
    assert is_safe("71-12=", "") and is_safe("11+12=", "23") and is_safe("11+12=", "")


@pytest.mark.parametrize("split", ["train", "val"])
def test_preference_rows_put_the_safer_response_first_with_rule_labels(split):
    rows = safety_preference_rows(split, seed=0)
    train, held_out = task_splits("arithmetic", 0)
    problems = train if split == "train" else held_out
    forbidden = sum(is_forbidden(p["prompt"]) for p in problems)
    assert len(rows) == 2 * forbidden + (len(problems) - forbidden)   # two pairs per forbidden prompt
    assert {r["prompt"] for r in rows} == {p["prompt"] for p in problems}   # the split's own prompts
    for r in rows:
        assert r["chosen_safe"] == is_safe(r["prompt"], r["chosen"]) and r["chosen_safe"]
        assert r["rejected_safe"] == is_safe(r["prompt"], r["rejected"])
        assert r["rejected_safe"] != is_forbidden(r["prompt"])   # forbidden: the refusal beats an answer
    assert rows == safety_preference_rows(split, seed=0)   # deterministic
    allowed_first = [r["chosen"] == "" for r in rows if not is_forbidden(r["prompt"])]
    assert 0.4 < sum(allowed_first) / len(allowed_first) < 0.6   # equally safe: either order


def test_rule_metrics_count_by_hand():
    prompts = ["71-1=", "12+3=", "12+4=", "75-1=", "80-70=", "10+10="]
    responses = ["", "15", "17", "74", "11", ""]
    answers = ["70", "15", "16", "74", "10", "20"]
    # allowed: 12+3 right, 12+4 wrong, 10+10 refused; forbidden: 71-1 refused, 75-1 and 80-70 answered
    assert rule_metrics(prompts, responses, answers) == {
        "answer_accuracy": 1 / 3, "refusal_rate": 1 / 3, "over_refusal": 1 / 3, "unsafe_fraction": 2 / 6}


def test_lambda_update_is_gradient_ascent_in_log_space():
    update = algos.update_log_lambda
    # log λ' = log λ + lr·λ·(J − d)
    assert update(0.0, mean_cost=3.0, threshold=1.0, lr=0.1) == pytest.approx(0.2)
    assert update(math.log(2.0), mean_cost=0.0, threshold=1.0, lr=0.5) == pytest.approx(math.log(2.0) - 1.0)
    assert update(math.log(4.0), 10.0, 0.0, lr=1.0, lambda_max=5.0) == pytest.approx(math.log(5.0))   # clamped
    assert update(math.log(4.0), 10.0, 0.0, lr=1.0) == pytest.approx(math.log(4.0) + 40.0)   # 0: no bound
    assert update(-math.inf, 10.0, 0.0, lr=1.0) == -math.inf   # λ = 0 stays 0
    assert update(0.3, 10.0, 0.0, lr=0.0) == 0.3   # lr 0 holds λ


def test_lagrange_multiplier_follows_the_update_and_round_trips_its_state():
    lam = algos.LagrangeMultiplier(init=1.0, lr=0.1, lambda_max=5.0)
    lam.update(mean_cost=2.0, threshold=-1.0)   # above the threshold: λ grows
    assert lam.value == pytest.approx(math.exp(0.1 * 1.0 * 3.0))
    grown = lam.value
    lam.update(mean_cost=-3.0, threshold=-1.0)   # below: it shrinks
    assert lam.value == pytest.approx(math.exp(math.log(grown) + 0.1 * grown * -2.0))
    other = algos.LagrangeMultiplier(init=1.0, lr=0.1, lambda_max=5.0)
    other.load_state_dict(lam.state_dict())
    assert other.value == lam.value
    assert algos.LagrangeMultiplier(init=0.0, lr=0.1, lambda_max=5.0).value == 0.0


def test_lagrangian_advantage_by_hand():
    combine = algos.lagrangian_advantages
    reward, cost = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 1.0]])
    # (A_r − λ·A_c)/(1 + λ) with λ = 3: (1 − 1.5)/4, (−2 − 3)/4
    assert torch.allclose(combine(reward, cost, 3.0), torch.tensor([[-0.125, -1.25]]))
    assert torch.equal(combine(reward, cost, 0.0), reward)


# ---------------------------------------------------------------- the recipe end to end

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def run_recipe(model, out, ranks, *extra, timeout=400):
    # the tiny policy serves as reward and cost model too: a causal LM gets a new scalar head
    args = ["--model.path", model, "--reward.model", model, "--cost.model", model, "--trainer.output-dir", out,
            "--trainer.steps", 3, "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 4,
            "--trainer.eval-size", 8, "--trainer.logging.no-progress-bars", "--trainer.no-export",
            "--algo.critic-warmup", 1, "--algo.cost-threshold", -0.5, "--algo.lambda-lr", 0.5, *extra]
    return torchrun(str(RECIPE), ranks, args, timeout=timeout)


def logged(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("ranks,placement", [(2, "colocate"), (4, "split")])
def test_safe_rlhf_runs_and_lambda_follows_the_logged_costs(tiny_model, tmp_path, ranks, placement):
    out = tmp_path / placement
    run_recipe(tiny_model, out, ranks, "--trainer.placement", placement).check()
    rows = logged(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("reward/mean", "cost/mean", "cost/unsafe_fraction", "lambda", "kl/mean", "critic/loss",
                "cost_critic/loss", "safety/answer_accuracy", "safety/refusal_rate", "reward/allowed_mean"):
        assert key in rows[1], key
    assert "actor/loss" not in rows[1] and "actor/loss" in rows[2]   # the critics' warm-up step
    assert "eval/refusal_rate" in rows[0] and "eval/answer_accuracy" in rows[-1]
    # λ waits out the warm-up, then log λ moves by lr·λ·(J − d) with J the step's logged mean cost
    assert rows[1]["lambda"] == 1.0
    log_lambda = 0.0
    for r in rows[2:]:
        log_lambda = min(log_lambda + 0.5 * math.exp(log_lambda) * (r["cost/mean"] + 0.5), math.log(5.0))
        assert r["lambda"] == pytest.approx(math.exp(log_lambda), rel=1e-6)


@pytest.mark.dist
def test_lambda_init_0_holds_lambda_at_0(tiny_model, tmp_path):
    out = tmp_path / "ppo"
    run_recipe(tiny_model, out, 2, "--algo.lambda-init", 0).check()
    assert [r["lambda"] for r in logged(out)[1:]] == [0.0, 0.0, 0.0]


@pytest.mark.dist
def test_a_missing_cost_model_stops_before_work(tiny_model, tmp_path):
    run = run_recipe(tiny_model, tmp_path / "out", 2, "--cost.model", str(tmp_path / "nope"), timeout=200)
    assert not run.timed_out and run.returncode != 0, run.output
    assert "--cost.model" in run.output and "no config.json" in run.output, run.output
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
