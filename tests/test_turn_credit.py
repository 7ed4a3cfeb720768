"""Per-turn credit (recipes/agent.py --agent.credit turn): hflow.algos.turn_advantages against the
formula worked by hand in plain Python, the columns a rollout batch carries for it (turn_index,
turn_rewards) built from real sessions, the multi_question environment, and the flag
combinations the recipe refuses."""
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from hflow import algos
from hflow.agents import (AgentSession, Environment, Segment, StepResult, TextRenderer, Trajectory, run_episode,
                          trajectory_columns, trajectory_tensors)
from hflow.agents.multi_question import MultiQuestion, follow_ups
from hflow.agents.registry import BUILTIN_ENVIRONMENTS
from hflow.validation import ConfigError

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "agent.py"
EPS = 1e-6


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol)


# ------------------------------------------------------------------------------ the formula by hand

# four trajectories of two prompts (0, 0, 0 | 1): their turns' rewards (a row's own number of turns)
REWARDS = [[1.0, 0.0, 1.0], [0.0, 1.0], [1.0, 1.0, 0.0], [0.5, 2.0]]
GROUPS = [0, 0, 0, 1]
# each row's response: the turn of each token, -1 under an observation or padding (width 8)
TOKENS = [[0, 0, -1, 1, -1, 2, 2, -1],
          [0, -1, 1, 1, -1, -1, -1, -1],
          [0, -1, 1, -1, 2, -1, -1, -1],
          [0, 0, 0, -1, 1, -1, -1, -1]]


def by_hand_returns(rewards, gamma):
    """G_t = sum over t' >= t of gamma**(t' - t) * r_t', term by term."""
    return [sum(gamma ** (u - t) * rewards[u] for u in range(t, len(rewards))) for t in range(len(rewards))]


def by_hand_advantages(gamma, episode_weight, norm_by_std):
    """The per-turn advantage of every (row, turn), from lists: the step-wise group of (prompt,
    turn), the episode group of the prompt, statistics.mean / stdev (unbiased)."""
    returns = [by_hand_returns(r, gamma) for r in REWARDS]

    def relative(value, values):
        if len(values) < 2:
            return 0.0
        a = value - statistics.mean(values)
        return a / (statistics.stdev(values) + EPS) if norm_by_std else a
    out = []
    for i, g in enumerate(returns):
        episode = relative(g[0], [returns[j][0] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i]])
        row = []
        for t in range(len(g)):
            same_turn = [returns[j][t] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i] and len(returns[j]) > t]
            row.append(relative(g[t], same_turn) + episode_weight * episode)
        out.append(row)
    return out


def inputs():
    rewards, valid = algos.pad_turn_rewards(REWARDS)
    turn_index = torch.tensor(TOKENS)
    mask = (turn_index >= 0).float()
    return turn_index, rewards, valid, mask


def test_pad_turn_rewards_pads_each_rows_turns_with_invalid_zeros():
    rewards, valid = algos.pad_turn_rewards([[1.0, 2.0], [], [3.0]])
    assert rewards.tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]
    assert valid.tolist() == [[True, True], [False, False], [True, False]]
    rewards, valid = algos.pad_turn_rewards([[], []])   # no turn at all: one invalid column
    assert rewards.shape == valid.shape == (2, 1) and not valid.any()


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
def test_turn_returns_by_hand(gamma):
    _, rewards, valid, _ = inputs()
    returns = algos.turn_returns(rewards, valid, gamma)
    for i, r in enumerate(REWARDS):
        assert close(returns[i, :len(r)], by_hand_returns(r, gamma))
        assert (returns[i, len(r):] == 0).all()
    # gamma 0.5, row 0 by hand: G_2 = 1, G_1 = 0 + 0.5 * 1, G_0 = 1 + 0.5 * 0 + 0.25 * 1
    if gamma == 0.5:
        assert close(returns[0], [1.25, 0.5, 1.0])


@pytest.mark.parametrize("gamma, episode_weight, norm_by_std", [
    (1.0, 0.0, True), (0.0, 0.0, True), (0.5, 1.0, True), (0.9, 0.5, False)])
def test_turn_advantages_by_hand(gamma, episode_weight, norm_by_std):
    turn_index, rewards, valid, mask = inputs()
    adv = algos.turn_advantages(turn_index, rewards, valid, mask, torch.tensor(GROUPS), gamma=gamma,
                                episode_weight=episode_weight, norm_by_std=norm_by_std)
    expected = by_hand_advantages(gamma, episode_weight, norm_by_std)
    for i, row in enumerate(TOKENS):
        assert close(adv[i], [expected[i][t] if t >= 0 else 0.0 for t in row]), (i, adv[i], expected[i])


def test_turn_advantages_worked_through_for_one_group():
    """gamma 1, per-turn alone, std-normalised, prompt 0's three trajectories written out."""
    turn_index, rewards, valid, mask = inputs()
    adv = algos.turn_advantages(turn_index, rewards, valid, mask, [0, 0, 0, 1], gamma=1.0)
    # returns-to-go: row 0 [2, 1, 1], row 1 [1, 1], row 2 [2, 1, 0]
    # turn 0: {2, 1, 2}: mean 5/3, std sqrt(1/3);  turn 1: {1, 1, 1}: all 0;  turn 2: {1, 0}: mean 1/2, std sqrt(1/2)
    s0, s2 = math.sqrt(1 / 3) + EPS, math.sqrt(1 / 2) + EPS
    assert close(adv[0], [(1 / 3) / s0] * 2 + [0.0, 0.0, 0.0] + [0.5 / s2] * 2 + [0.0])
    assert close(adv[1], [(-2 / 3) / s0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert close(adv[2], [(1 / 3) / s0, 0.0, 0.0, 0.0, -0.5 / s2, 0.0, 0.0, 0.0])
    # prompt 1 has one trajectory: no baseline, every advantage 0
    assert (adv[3] == 0).all()


def test_only_the_masks_tokens_get_an_advantage_and_a_disagreement_is_refused():
    turn_index, rewards, valid, mask = inputs()
    half = mask.clone()
    half[0, 5:] = 0   # turn 2's tokens of row 0 not trained on (e.g. padding after a concat)
    adv = algos.turn_advantages(turn_index, rewards, valid, half, GROUPS)
    assert (adv[0, 5:] == 0).all() and (adv[half == 0] == 0).all()
    bad = turn_index.clone()
    bad[1, 1] = 2   # row 1 has no turn 2
    with pytest.raises(ValueError, match="belongs to no turn"):
        algos.turn_advantages(bad, rewards, valid, (bad >= 0).float(), GROUPS)
    with pytest.raises(ValueError, match="belongs to no turn"):   # a model token with no turn
        algos.turn_advantages(turn_index, rewards, valid, torch.ones_like(mask), GROUPS)


def test_with_one_turn_per_trajectory_it_is_grpo_on_the_turns_reward():
    """One turn each: the step-wise group is the prompt's group, so per-turn credit (and the
    episode term alone) are GRPO's advantage on the score."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]).float()
    turn_index = torch.where(mask.bool(), 0, -1)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    grpo = algos.grpo_advantages(scores, groups, mask)
    rewards, valid = scores[:, None], torch.ones(6, 1, dtype=torch.bool)
    assert close(algos.turn_advantages(turn_index, rewards, valid, mask, groups), grpo)
    assert close(algos.turn_advantages(turn_index, rewards, valid, mask, groups, episode_weight=1.0), 2 * grpo)


# ------------------------------------------------------------------------------ the batch's columns

@pytest.fixture(scope="module")
def tok():
    from hflow.default.model import build_tokenizer
    return build_tokenizer()


class Turns(Environment):
    """Rewards its turns as told; fails (raises) when told None."""

    def __init__(self, rewards):
        self.rewards = list(rewards)

    def reset(self, row):
        return row["prompt"]

    def step(self, text):
        reward = self.rewards.pop(0)
        if reward is None:
            raise RuntimeError("broken")
        return StepResult(None if not self.rewards else "next=", reward=reward, done=not self.rewards)


class Say:
    def __init__(self, tok, turns):
        self.tok, self.turns = tok, list(turns)

    def __call__(self, prompt_ids, max_new_tokens):
        ids = self.tok.encode(self.turns.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return ids, [-0.5] * len(ids)


def play(tok, rewards, turns):
    return run_episode(AgentSession(Turns(rewards), TextRenderer(tok), {"prompt": "1+1="}), Say(tok, turns))


def test_turn_index_and_turn_rewards_from_sessions(tok):
    done = play(tok, [1.0, 0.0, 1.0], ["2", "7", "33"])
    failed = play(tok, [1.0, None], ["2", "5"])            # the environment raised on turn 1: env_error
    assert failed.failed and failed.turn_rewards == [1.0]
    tensors = trajectory_tensors([done, failed], pad_id=tok.pad_token_id)
    columns = trajectory_columns([done, failed])
    turns = tensors["turn_index"]
    assert turns.dtype == torch.long and turns.shape == tensors["response_mask"].shape
    # by hand: each turn's tokens carry its number, each observation -1, and the padding -1
    expected = []
    for k, s in enumerate([s for s in done.segments]):
        expected += [sum(x.from_model for x in done.segments[:k]) if s.from_model else -1] * len(s.token_ids)
    assert turns[0].tolist() == expected and set(expected) == {-1, 0, 1, 2}
    assert ((turns >= 0) == tensors["response_mask"].bool()).all()   # -1 exactly where nothing is trained
    assert turns[1, len(failed.response_ids()):].eq(-1).all()
    # rewards per model turn; a failed trajectory's are all 0 (its rule), one per turn it played
    assert columns["turn_rewards"] == [[1.0, 0.0, 1.0], [0.0, 0.0]]
    assert columns["trajectory_reward"].tolist() == [2.0, 0.0]


def test_a_turn_cut_short_before_the_environment_answered_it_has_reward_0(tok):
    t = Trajectory([5, 6], [Segment([7, 8], [-0.1, -0.2]), Segment([9], None), Segment([7], [-0.3])],
                   turn_rewards=[1.0])
    t.finish("max_tokens")
    assert trajectory_columns([t])["turn_rewards"] == [[1.0, 0.0]]
    assert trajectory_tensors([t], pad_id=0)["turn_index"].tolist() == [[0, 0, -1, 1]]


def test_the_columns_give_per_turn_advantages_end_to_end(tok):
    """Two trajectories of one prompt, same first answer, different second: only turn 1's tokens
    get credit (gamma 0), in opposite directions."""
    right = play(tok, [1.0, 1.0], ["2", "4"])
    wrong = play(tok, [1.0, 0.0], ["2", "5"])
    tensors, columns = trajectory_tensors([right, wrong], pad_id=0), trajectory_columns([right, wrong])
    rewards, valid = algos.pad_turn_rewards(columns["turn_rewards"])
    adv = algos.turn_advantages(tensors["turn_index"], rewards, valid, tensors["response_mask"], [0, 0], gamma=0.0)
    turn = tensors["turn_index"]
    assert (adv[turn == 0] == 0).all() and (adv[turn == -1] == 0).all()
    assert (adv[0][turn[0] == 1] > 0.7).all() and (adv[1][turn[1] == 1] < -0.7).all()


# ------------------------------------------------------------------------------ the environment

def test_multi_question_asks_the_rows_problem_then_the_same_follow_ups_for_every_sample(tok):
    row = {"prompt": "27+82=", "answer": "109"}
    more = follow_ups("27+82=", 2)
    assert more == follow_ups(" 27+82= ", 2) and len({p for p, _ in more}) == 2
    for problem, answer in more:
        a, b = problem[:-1].split("+")
        assert len(a) == len(b) == 2 and int(answer) == int(a) + int(b)
    assert all(int(a) - int(b) == int(ans) >= 0 for a, b, ans in
               ((*p[:-1].split("-"), ans) for p, ans in follow_ups("47-35=", 20)))
    env = BUILTIN_ENVIRONMENTS["multi_question"](reward_fn="arithmetic")
    t = run_episode(AgentSession(env, TextRenderer(tok), row), Say(tok, ["109", "0", more[1][1]]))
    assert t.finish_reason == "done" and t.turn_rewards == [1.0, 0.0, 1.0] and t.reward() == 2.0
    observations = [tok.decode(s.token_ids) for s in t.segments if not s.from_model]
    assert observations == [p for p, _ in more]
    with pytest.raises(ValueError, match="problems like"):
        MultiQuestion().reset({"prompt": "What is 2 and 2?", "answer": "4"})


# ------------------------------------------------------------------------------ the recipe's flags

@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("agent_recipe_turn_credit", RECIPE)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("agent, algo, message", [
    ({"credit": "turn", "reward": "fn"}, {}, "--agent.credit turn with --agent.reward fn: per-turn credit needs"),
    ({"credit": "turn", "reward": "sum"}, {}, "--agent.credit turn with --agent.reward sum"),
    ({"credit": "turn"}, {"estimator": "rloo"}, "--agent.credit turn with --algo.estimator rloo"),
    ({"credit": "turn"}, {"kl_coef": 0.1, "kl_in_reward": True}, "--agent.credit turn with --algo.kl-in-reward"),
    ({"credit": "turn", "turn_discount": 1.5}, {}, "--agent.turn-discount 1.5: must be in [0, 1]"),
    ({"episode_weight": -1.0}, {}, "--agent.episode-weight -1.0: must be >= 0"),
])
def test_the_recipe_refuses_what_per_turn_credit_cannot_do_in_one_line(recipe, agent, algo, message):
    import dataclasses
    cfg = recipe.Config()
    cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, env="multi_question", **agent),
                              algo=dataclasses.replace(cfg.algo, **algo))
    with pytest.raises(ConfigError) as e:
        recipe.check_agent(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_recipe_takes_turn_credit_with_the_environments_reward(recipe):
    import dataclasses
    cfg = recipe.Config()
    for estimator in ("grpo", "drgrpo"):
        cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, env="multi_question", credit="turn",
                                                                 turn_discount=0.0, episode_weight=1.0),
                                  algo=dataclasses.replace(cfg.algo, estimator=estimator, kl_coef=0.1))
        recipe.check_agent(cfg)
