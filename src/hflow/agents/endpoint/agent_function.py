"""A user's agent, written against the OpenAI client: a function hflow calls once per trajectory.

    def solve(row: dict, base_url: str) -> float:          # or `async def`
        client = openai.OpenAI(base_url=base_url, api_key="hflow")
        ...  # any loop of client.chat.completions.create(model="hflow", messages=..., tools=...)
        return reward                                       # this trajectory's score; None: 0

It may return a dict instead: {"reward": r, "tool_calls": 2, ...}, its other numbers counted on
the trajectory as an Environment's StepResult.info is (agent/tool_calls and the like); or
{"turn_rewards": [r0, r1, ...]}, a reward for each of its turns in order (--agent.credit turn
puts each on its own turn's tokens; the trajectory's reward is their sum).

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
import threading
from typing import Callable, Union


def is_agent_function(obj) -> bool:
    """Whether an environment spec resolved to an agent function (a function, or a partial of
    one), not an Environment class or a factory of one."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    return inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)


def call_agent(fn: Callable, row: dict, base_url: str) -> tuple[Union[float, list[float]], dict]:
    """Run one agent to its end, waiting on this thread (an async one on the process's shared
    event loop, beside the others: it must not block that loop);
    returns its reward (None: 0) or its turns' rewards (a list), and the numbers it counted.
    Whatever it raises is raised."""
    result = fn(row, base_url)
    if inspect.isawaitable(result):
        result = asyncio.run_coroutine_threadsafe(_awaited(result), _shared_loop()).result()
    counts = {}
    if isinstance(result, dict):
        counts = {k: v for k, v in result.items() if k not in ("reward", "turn_rewards")}
        bad = [k for k, v in counts.items() if not _number(v)]
        if bad:
            raise TypeError(f"the agent function returned {bad[0]}={counts[bad[0]]!r}: its counts must be numbers")
        if "turn_rewards" in result:
            if "reward" in result:
                raise TypeError("the agent function returned both reward and turn_rewards: the reward is their sum")
            turns = result["turn_rewards"]
            if not isinstance(turns, (list, tuple)) or not all(_number(r) for r in turns):
                raise TypeError(f"the agent function returned turn_rewards={turns!r}, not a list of finite numbers")
            return [float(r) for r in turns], counts
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


_loop = None
_loop_lock = threading.Lock()


def _shared_loop() -> asyncio.AbstractEventLoop:
    """One event loop, on a thread of its own, for every async agent of this process: their
    coroutines interleave there as async code expects (a library's loop-bound state, such as a
    server verifiers starts once, is shared, not duplicated per loop), and a thread waits for each."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="hflow-async-agents").start()
        return _loop
