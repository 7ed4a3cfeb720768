"""A user's agent, written against the OpenAI client: a function hflow calls once per trajectory.

    def solve(row: dict, base_url: str) -> float:          # or `async def`
        client = openai.OpenAI(base_url=base_url, api_key="hflow")
        ...  # any loop of client.chat.completions.create(model="hflow", messages=..., tools=...)
        return reward                                       # this trajectory's score; None: 0

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
from typing import Callable, Optional


def is_agent_function(obj) -> bool:
    """Whether an environment spec resolved to an agent function (a function, or a partial of
    one), not an Environment class or a factory of one."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    return inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)


def call_agent(fn: Callable, row: dict, base_url: str) -> Optional[float]:
    """Run one agent to its end on this thread (an async one in an event loop of its own) and
    return its reward as a float (None: it returned nothing). Whatever it raises is raised."""
    result = fn(row, base_url)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, numbers.Real) or not math.isfinite(float(result)):
        raise TypeError(f"the agent function returned {result!r}, not a finite number (its reward) or None")
    return float(result)


async def _awaited(awaitable):
    return await awaitable
