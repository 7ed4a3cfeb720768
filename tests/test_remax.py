"""ReMax: its advantages by hand, the greedy row of the rollout against transformers' greedy
generate, and recipes/remax.py end to end, colocated and split."""
import importlib.util
import os
import sys

import pytest
import torch

from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir
from test_recipes import RECIPES, rows, small_run, tiny_model  # noqa: F401  (tiny_model is a fixture)


def load_recipe():
    spec = importlib.util.spec_from_file_location("remax_recipe", RECIPES / "remax.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_advantages_are_sample_minus_greedy_of_its_prompt_by_hand():
    remax = load_recipe()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])   # prompt 0: rows 0-1, prompt 1: rows 2-3
    greedy = torch.tensor([0.25, 1.0])
    adv = remax.remax_advantages(scores, greedy, mask)
    expected = torch.tensor([[0.75, 0.75, 0], [-0.25, 0, 0], [-0.5, -0.5, -0.5], [0, 0, 0]])
    assert torch.equal(adv, expected)

    # with a KL in the reward: A_t = s - b - beta * (kl_t + kl_{t+1} + ...), masked-out KL ignored
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.4, 9.0, 9.0], [0.1, 0.1, 0.2], [0.0, 0.3, 9.0]]) * mask
    adv = remax.remax_advantages(scores, greedy, mask, kl, kl_coef=0.5)
    expected = torch.tensor([[0.75 - 0.5 * 0.3, 0.75 - 0.5 * 0.2, 0],
                             [-0.25 - 0.5 * 0.4, 0, 0],
                             [-0.5 - 0.5 * 0.4, -0.5 - 0.5 * 0.3, -0.5 - 0.5 * 0.2],
                             [0 - 0.5 * 0.3, 0 - 0.5 * 0.3, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)


@pytest.mark.dist
def test_generate_with_greedy(tmp_path):
    """One greedy row per prompt, equal to transformers' greedy generate; the sampled rows are
    those of a generate without it (same seed); tp_g 1 and 2 on 2 ranks."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(os.path.join(PROGRAMS, "remax_greedy_rollout.py"), nproc=2, args=[path, "1,2"],
                   tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert run.output.count("greedy rows equal transformers' generate") == 2, run.output


def reward_model_dir(policy_dir, path) -> str:
    """A random sequence classifier on the policy's vocabulary (so it scores its token ids)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(policy_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.dist
@pytest.mark.parametrize("placement", ["colocate", "split"])
def test_remax_recipe_runs(tiny_model, tmp_path, placement):  # noqa: F811
    """Two steps with a KL to the reference; split: the reference and a reward model (added to
    the rule) on their own rank. Metrics logged, held-out accuracy by the rule."""
    out = tmp_path / placement
    extra = ["--algo.kl-coef", 0.01, "--trainer.placement", placement, "--trainer.no-export"]
    if placement == "split":
        extra += ["--reward.model", reward_model_dir(tiny_model, tmp_path / "rm"), "--reward.fn", "arithmetic",
                  "--reward.model-weight", 0.5]
    torchrun(str(RECIPES / "remax.py"), 2, small_run(tiny_model, out, 2, *extra), timeout=400).check()
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert "eval/reward_mean" in logged[0] and "eval/reward_mean" in logged[-1]
    for key in ("reward/mean", "reward/greedy_mean", "kl/mean", "actor/loss", "actor/grad_norm",
                "response_length/mean", "time/generate_s", "time/update_s", "throughput/tokens_per_s"):
        assert key in logged[1], key
    assert abs(logged[1]["kl/mean"]) < 1e-4   # the reference is the policy that sampled step 1
    if placement == "split":
        step = logged[1]
        assert step["reward/mean"] == pytest.approx(step["reward/rule_mean"] + 0.5 * step["reward/rm_mean"], abs=1e-5)
