"""gymnasium environments with discrete (or text) actions as hflow environments:
`--agent.env gym:FrozenLake-v1` (or `gymnasium:FrozenLake-v1`).

    env = GymnasiumEnv("FrozenLake-v1")
    env.reset({"seed": 0})    # "FrozenLake-v1: reply with an action, an integer from 0 to 3.\n\n[S]FFF\n...\nobservation: 0"
    env.step("2")             # StepResult("  (Right)\nS[F]FF\n...\nobservation: 1", reward=0.0, done=False)

reset(row) makes the environment with `gymnasium.make(name, render_mode="ansi")` where it renders
text (the toy-text ones: FrozenLake, CliffWalking, Taxi), else without a render mode, and resets
it with the row's seed (adapters.row_seed). What the model reads is the text render, its ANSI
colour put as square brackets around the coloured text (FrozenLake's player, Taxi's taxi and
passenger), and then the observation itself (`observation: 0`); the first one starts with the
actions it may take. A turn's first integer is the action of a Discrete space; a reply without a
valid one is told so (`invalid_actions` counted) and the environment does not step. A Text action
space takes the turn as it is. The step's reward is gymnasium's; terminated or truncated (the
registered TimeLimit) ends the trajectory.
"""
from __future__ import annotations

import functools
import re
from typing import Optional

from hflow.agents.adapters import one_line, require, row_seed
from hflow.agents.environment import Environment, StepResult

_COLOURED = re.compile(r"\x1b\[[0-9;]*m([^\x1b]*)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_INTEGER = re.compile(r"-?\d+")


def plain(render: str) -> str:
    """An ANSI render as plain text: coloured text in square brackets, other escapes dropped."""
    return _ESCAPE.sub("", _COLOURED.sub(lambda m: f"[{m[1]}]", render))


def make_env(gym, name: str, kwargs: Optional[dict] = None):
    """`gymnasium.make(name)`, rendering text (render_mode="ansi") where the environment can."""
    env = gym.make(name, **(kwargs or {}))
    if "ansi" not in (env.metadata.get("render_modes") or []):
        return env
    env.close()
    return gym.make(name, render_mode="ansi", **(kwargs or {}))


class GymnasiumEnv(Environment):
    """One gymnasium environment per trajectory (see the module docstring)."""

    def __init__(self, name: str, **kwargs):
        self.name, self.kwargs = name, kwargs
        self.env = None

    def reset(self, row: dict):
        gym = require("gymnasium", f"gym:{self.name}")
        self.env = make_env(gym, self.name, self.kwargs)
        observation, _ = self.env.reset(seed=row_seed(row))
        return f"{self.instructions()}\n\n{self.show(observation)}"

    def instructions(self) -> str:
        space = self.env.action_space
        if hasattr(space, "n"):
            first = int(getattr(space, "start", 0))
            return f"{self.name}: reply with an action, an integer from {first} to {first + int(space.n) - 1}."
        return f"{self.name}: reply with an action, text."

    def show(self, observation) -> str:
        render = self.env.render() if self.env.render_mode == "ansi" else None
        text = plain(render).strip("\n") + "\n" if isinstance(render, str) and render.strip() else ""
        return f"{text}observation: {observation}"

    def action(self, text: str):
        """The action a turn names, or None."""
        space = self.env.action_space
        if not hasattr(space, "n"):
            return text   # a Text space
        found = _INTEGER.search(text)
        return int(found[0]) if found and space.contains(int(found[0])) else None

    def step(self, text: str) -> StepResult:
        action = self.action(text)
        if action is None:
            return StepResult(f"Not an action: {self.instructions().split(': ', 1)[1]}", info={"invalid_actions": 1})
        observation, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        if done:
            self.env.close()
        return StepResult(None if done else self.show(observation), reward=float(reward), done=done)


@functools.lru_cache(maxsize=None)
def check_env(name: str, spec: str) -> None:
    """The environment exists, starts here and takes discrete or text actions; a ValueError otherwise."""
    gym = require("gymnasium", spec)
    try:
        env = make_env(gym, name)
    except Exception as e:   # gymnasium.error.NameNotFound, DeprecatedEnv, a missing dependency (box2d, mujoco)
        raise ValueError(f"environment {spec!r}: gymnasium cannot make {name}: {one_line(e)}") from None
    space = env.action_space
    env.close()
    from gymnasium import spaces
    if not isinstance(space, (spaces.Discrete, spaces.Text)):
        raise ValueError(f"environment {spec!r}: {name} acts in {space}; a model's turn can name a Discrete "
                         "action (an integer) or be a Text one")


def factory(name: str, spec: str):
    check_env(name, spec)
    return functools.partial(GymnasiumEnv, name)
