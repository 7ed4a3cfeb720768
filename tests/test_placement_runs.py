"""Every placement a recipe can name runs PPO with all four models (actor, reference, critic,
reward model) on 4 CPU ranks to the same numbers as colocating them."""
import pytest

from dist import torchrun
from test_recipes import RECIPES, rows, small_run, tiny_model, without_timing  # noqa: F401 (fixture)
from test_reward_model import tiny_reward_model  # noqa: F401 (fixture)

PLACEMENTS = {"split": "split", "standalone": "standalone",
              "spec": "actor,ref:0-1;critic:2;reward:3"}


def ppo_rows(model, reward_model, out, placement):
    args = small_run(model, out, 2, "--trainer.no-export", "--algo.critic-warmup", 0,
                     "--reward.model", reward_model, "--reward.fn", "arithmetic", "--reward.model-weight", 0.5,
                     "--trainer.placement", placement)
    torchrun(str(RECIPES / "ppo.py"), 4, args, timeout=500).check()
    return [without_timing(r) for r in rows(out)]


@pytest.mark.dist
def test_every_placement_gives_the_colocated_numbers(tiny_model, tiny_reward_model, tmp_path):
    colocated = ppo_rows(tiny_model, tiny_reward_model, tmp_path / "colocate", "colocate")
    assert "reward/rm_mean" in colocated[1] and "critic/loss" in colocated[1] and "kl/mean" in colocated[1]
    for name, placement in PLACEMENTS.items():
        placed = ppo_rows(tiny_model, tiny_reward_model, tmp_path / name, placement)
        assert [r["step"] for r in placed] == [0, 1, 2]
        for a, b in zip(colocated, placed):
            assert a.keys() == b.keys(), name
            assert b == pytest.approx(a, rel=1e-4, abs=1e-5), (name, a["step"])


@pytest.mark.dist
def test_a_bad_spec_is_one_line_before_any_model_is_trained(tiny_model, tmp_path):
    run = torchrun(str(RECIPES / "ppo.py"), 4, small_run(tiny_model, tmp_path / "bad", 1,
                                                        "--trainer.placement", "actor:0-1;critic:1-3"), timeout=300)
    assert run.returncode != 0
    assert run.output.count("error: --trainer.placement") == 1, run.output
