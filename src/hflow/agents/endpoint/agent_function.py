"""A user's agent, written against the OpenAI client: a function hflow calls once per trajectory.

    def solve(row: dict, base_url: str) -> float:          # or `async def`
        client = openai.OpenAI(base_url=base_url, api_key="hflow")
        ...  # any loop of client.chat.completions.create(model="hflow", messages=..., tools=...)
        return reward                                       # this trajectory's score; None: 0

It may return a dict instead: {"reward": r, "tool_calls": 2, ...}, its other numbers counted on
the trajectory as an Environment's StepResult.info is (agent/tool_calls and the like).

`row` is the data row (its prompt, answer and other columns), `base_url` the session's own
address on hflow's endpoint: every request made through it is one turn of this trajectory.
`--agent.env path/to/file.py:solve` (or `package.module:solve`) names one.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from typing import Callable


def is_agent_function(obj) -> bool:
    """Whether an environment spec resolved to an agent function (a function, or a partial of
    one), not an Environment class or a factory of one."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    return inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)


def call_agent(fn: Callable, row: dict, base_url: str) -> tuple[float, dict]:
    """Run one agent to its end on this thread (an async one in an event loop of its own);
    returns its reward (None: 0) and the numbers it counted. Whatever it raises is raised."""
    result = fn(row, base_url)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    counts = {}
    if isinstance(result, dict):
        counts = {k: v for k, v in result.items() if k != "reward"}
        bad = [k for k, v in counts.items() if not _number(v)]
        if bad:
            raise TypeError(f"the agent function returned {bad[0]}={counts[bad[0]]!r}: its counts must be numbers")
        result = result.get("reward")
    if result is None:
        return 0.0, counts
    if not _number(result):
        raise TypeError(f"the agent function returned {result!r}, not a finite number (its reward), a dict or None")
    return float(result), counts


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


async def _awaited(awaitable):
    return await awaitable
