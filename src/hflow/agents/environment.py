"""The environment interface a user writes, in one file, named by ``module:Class`` or
``path/to/file.py:Class``:

    class Guess(Environment):
        def reset(self, row):                     # a data row -> the first observation
            self.secret = int(row["answer"])
            return row["prompt"]                  # text, or a list of chat messages
        def step(self, text):                     # the model's turn as text -> what happens
            guess = int(text.strip() or 0)
            if guess == self.secret:
                return StepResult(None, reward=1.0, done=True)
            return StepResult("higher" if guess < self.secret else "lower")

One instance serves one trajectory (make a fresh one per row and sample). ``self.limits`` is the
session's AgentLimits, set before ``reset``. A step that raises ends its trajectory as
env_error (reward 0, counted), one that raises AgentFailure as the failure it names; the run
goes on.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hflow.agents.limits import AgentLimits
from hflow.agents.render import Observation, ObservationError, as_messages
from hflow.rewards import get_reward_fn


@dataclass
class StepResult:
    observation: Optional[Observation] = None
    """What the model is shown next: text or chat messages (tool / user). None only with done."""
    reward: float = 0.0
    """This turn's reward; a trajectory's reward is its turns' summed (or discounted)."""
    done: bool = False
    info: dict = field(default_factory=dict)
    """Numbers here are summed into the trajectory's counts (tool_calls, ...), then averaged in metrics."""


class AgentFailure(Exception):
    """Raised by a step to end its trajectory as a failure (reward 0), counted under `reason`."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


class Environment:
    limits: AgentLimits = AgentLimits()

    def reset(self, row: dict) -> Observation:
        raise NotImplementedError

    def step(self, text: str) -> StepResult:
        raise NotImplementedError

    def tool_schemas(self) -> Optional[list[dict]]:
        """The JSON schemas a chat template is given as tools=, if the environment has tools."""
        return None


def step_result_problem(result) -> Optional[str]:
    """What is wrong with a step's return value (it is garbage), or None."""
    if not isinstance(result, StepResult):
        return f"step returned {type(result).__name__}, not a StepResult"
    if not isinstance(result.reward, numbers.Real) or not math.isfinite(float(result.reward)):
        return f"step returned the reward {result.reward!r}, not a finite number"
    if not isinstance(result.done, bool):
        return f"step returned done={result.done!r}, not a bool"
    if not isinstance(result.info, dict):
        return f"step returned info of type {type(result.info).__name__}, not a dict"
    if result.observation is None:
        return None if result.done else "step returned no observation but is not done"
    try:
        as_messages(result.observation)
    except ObservationError as e:
        return f"step returned a bad observation: {e}"
    return None


def load_environment(spec: str):
    """An environment class by ``package.module:Class`` or ``path/to/file.py:Class`` (or an agent
    function, ``file.py:solve``, which hflow serves the engine to over HTTP). A file's
    folder is put on sys.path (at the end, shadowing nothing), so that tool worker processes can
    import the tools defined in it too."""
    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not attr:
        raise ValueError(f"environment {spec!r}: expected 'package.module:Class' or 'path/to/file.py:Class'")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"environment {spec!r}: no file {path}")
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        target = path.stem
        found = importlib.util.find_spec(target)
        if found is None or found.origin is None or Path(found.origin).resolve() != path:
            raise ValueError(f"environment {spec!r}: the module name {target!r} is taken by "
                             f"{found.origin if found else 'a module'}; rename the file")
        cls = _import(f"{target}:{attr}", spec)
    else:
        cls = _import(spec, spec)
    if inspect.isfunction(cls):
        return cls   # an agent written against the OpenAI client (hflow.agents.endpoint.agent_function)
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"environment {spec!r} is not a class with reset(row) and step(text) "
                         "(subclass hflow.agents.Environment), nor an agent function solve(row, base_url)")
    return cls


def _import(target: str, spec: str):
    try:
        return get_reward_fn(target)   # rewards' module:attribute loader, with its PYTHONPATH hint
    except ValueError as e:
        raise ValueError(str(e).replace(f"reward function {target!r}", f"environment {spec!r}")
                         .replace("is not callable", "is not a class")) from None
