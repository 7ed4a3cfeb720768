"""The agent recipe's default task: 3-digit x 2-digit products, the built-in environments'
scoring of the final answer, and the streams the tool-calling warm-up teaches, which must be
token for token what a real session of that policy produces."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hflow.agents import AgentSession, TextRenderer, run_episode
from hflow.data import TASKS, Prompt, task_splits
from hflow.default.tool_use import tool_trajectory
from hflow.agents import BUILTIN_ENVIRONMENTS

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "agent.py"


@pytest.fixture(scope="module")
def tok():
    from hflow.default.model import build_tokenizer
    return build_tokenizer()


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("agent_recipe", RECIPE)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_multiply_task_poses_every_3_by_2_digit_product_once():
    problems = TASKS["multiply"].problems()
    assert len(problems) == 900 * 90 == len({p["prompt"] for p in problems})
    assert {"prompt": "127*46=", "answer": "5842"} in problems
    assert all(int(p["answer"]) == eval(p["prompt"][:-1]) for p in problems[::997])
    train, held_out = task_splits("multiply", seed=0)
    assert len(held_out) == 500 and not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}


class Replay:
    """A model that plays back the taught stream's model turns, as the engine would sample them."""

    def __init__(self, turns):
        self.turns = list(turns)

    def __call__(self, prompt_ids, max_new_tokens):
        ids = self.turns.pop(0)
        return ids, [-0.5] * len(ids)


@pytest.mark.parametrize("use_tool", [True, False], ids=["calls the calculator", "answers at once"])
def test_the_taught_stream_is_what_a_session_of_the_calculator_env_produces(tok, use_tool):
    row = {"prompt": "127*46=", "answer": "5842"}
    prompt = Prompt(tok.encode(row["prompt"]), row["prompt"], row["answer"])
    renderer = TextRenderer(tok)
    taught = tool_trajectory(prompt, tok, renderer, use_tool)
    turns = [s.token_ids for s in taught.segments if s.from_model]
    env = BUILTIN_ENVIRONMENTS["calculator"](reward_fn="arithmetic")
    played = run_episode(AgentSession(env, renderer, row), Replay(turns))
    assert played.finish_reason == "done" and played.reward() == 1.0
    assert taught.token_ids() == played.token_ids() and taught.response_mask() == played.response_mask()
    expected = "127*46=<calc>127*46</calc><|im_end|><result>5842</result>5842<|im_end|>" if use_tool else \
        "127*46=5842<|im_end|>"
    assert tok.decode(taught.token_ids()) == expected
    # the tool's result is read, never trained on: masked exactly where "<result>5842</result>" is
    masked = [i for i, m in zip(taught.response_ids(), taught.response_mask()) if not m]
    assert tok.decode(masked) == ("<result>5842</result>" if use_tool else "")


def test_the_built_in_environments_score_the_final_answer_and_no_tools_answers_no_call(tok):
    calc = BUILTIN_ENVIRONMENTS["calculator"](reward_fn="arithmetic")
    # a row as the rollout hands it over (row_dicts): the ground truth is also a column of its own
    calc.reset({"prompt": "127*46=", "answer": "5842", "ground_truth": "5842", "prompt_ids": [1, 2]})
    first = calc.step("<calc>127*46</calc>")
    assert not first.done and first.observation[0]["content"] == "5842" and first.reward == 0.0
    assert calc.step("5842").reward == 1.0
    off = BUILTIN_ENVIRONMENTS["no_tools"](reward_fn="arithmetic")
    off.reset({"prompt": "127*46=", "answer": "5842"})
    unanswered = off.step("<calc>127*46</calc>")   # no tool: the call is the final answer, and wrong
    assert unanswered.done and unanswered.reward == 0.0
    off.reset({"prompt": "127*46=", "answer": "5842"})
    assert off.step("5842").reward == 1.0


def test_the_recipe_gives_a_built_in_environment_the_reward_rule(recipe):
    cfg = recipe.Config()
    assert cfg.data.task == "multiply" and cfg.agent.reward == "env"
    env = recipe.environment(cfg)()
    assert env.reward_fn is not None and env.reward_fn("5842", "5842") == 1.0
    cfg.agent.env = "tests/programs/agent_envs.py:ThreeTurns"
    assert recipe.environment(cfg) == "tests/programs/agent_envs.py:ThreeTurns"   # a user's: as named


def test_the_taught_batch_trains_on_the_model_tokens_only(tok):
    from hflow.agents import trajectory_tensors
    renderer = TextRenderer(tok)
    prompts = [Prompt(tok.encode(f"{a}*46="), f"{a}*46=", str(a * 46)) for a in (127, 300)]
    streams = [tool_trajectory(p, tok, renderer, u) for p, u in zip(prompts, (True, False))]
    batch = trajectory_tensors(streams, tok.pad_token_id)
    trained = [tok.decode(r[m.bool()]) for r, m in zip(batch["responses"], batch["response_mask"])]
    assert trained == ["<calc>127*46</calc><|im_end|>5842<|im_end|>", "13800<|im_end|>"]
    assert torch.equal(batch["response_mask"].sum(1), torch.tensor([len(tok.encode("<calc>127*46</calc>")) + 1 + 5,
                                                                    6]))
