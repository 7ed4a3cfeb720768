"""Tool calls in worker processes, each under a deadline, many trajectories' calls at once.

A call that hangs (in C, in a loop, on a lock) can only be stopped by killing its process, so
tools run in hflow's reward workers (hflow.rewards.RewardPool: forkserver processes, a per-item
timeout after which the worker is killed and replaced, crashes caught). A RewardPool scores one
batch at a time, so the runner keeps several single-worker pools and lends each to one caller
(an environment step, on its own thread) at a time: the calls of different trajectories run
side by side in up to `max_workers` processes, and a slow one holds up nobody else.
Tools marked inline (the calculator) run in the calling thread: a process round trip would cost
more than they do.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import threading
from dataclasses import dataclass
from hflow.agents.tools import Tool, invoke
from hflow.rewards import RewardPool


@dataclass(frozen=True)
class ToolOutcome:
    status: str
    """ok | bad_input (the model's mistake, told to it) | error (raised, garbage, crash) | timeout."""
    text: str
    """The result, or what went wrong."""


def run_in_worker(fn, arguments_json: str, _ground_truth=None, **_) -> dict:
    """A reward worker's 'score function' for one call of `fn` (bound with partial): the outcome
    rides in the details. The pool loads it, and so imports the tool's module, under its load
    timeout: a tool's first call in a fresh worker is not charged for importing torch."""
    status, text = invoke(fn, json.loads(arguments_json))
    return {"score": 0.0, "status": status, "text": text}


class ToolRunner:
    """Calls tools from any number of threads, at most `max_workers` of them in processes at once."""

    def __init__(self, max_workers: int = 4):
        if max_workers < 1:
            raise ValueError(f"a tool runner needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._free: list[RewardPool] = []
        self._made = 0
        self._available = threading.Condition()
        self._closed = False

    def call(self, tool: Tool, arguments: dict, timeout_s: float) -> ToolOutcome:
        if tool.inline:
            return ToolOutcome(*invoke(tool.fn, arguments))
        try:
            arguments_json = json.dumps(arguments)
        except (TypeError, ValueError) as e:
            return ToolOutcome("bad_input", f"the arguments are not JSON: {e}")
        pool = self._borrow()
        try:
            scored = pool.score(functools.partial(run_in_worker, tool.fn), [arguments_json], [None], timeout=timeout_s)
        except TypeError as e:   # the tool does not pickle: a lambda, a function inside a function
            return ToolOutcome("error", str(e))
        finally:
            self._give_back(pool)
        if scored.failures[0] is None:
            details = scored.details[0]
            return ToolOutcome(details["status"], details["text"])
        if scored.metrics["reward/timeouts"]:
            return ToolOutcome("timeout", f"{tool.name}: {scored.failures[0]}")
        return ToolOutcome("error", f"{tool.name}: {scored.failures[0]}")

    def _borrow(self) -> RewardPool:
        with self._available:
            while True:
                if self._closed:
                    raise RuntimeError("the tool runner is closed")
                if self._free:
                    return self._free.pop()
                if self._made < self.max_workers:
                    self._made += 1
                    return RewardPool(num_workers=1)
                self._available.wait()

    def _give_back(self, pool: RewardPool) -> None:
        with self._available:
            if self._closed:
                pool.close()
            else:
                self._free.append(pool)
            self._available.notify()

    def close(self) -> None:
        """Stop the idle workers now (a pool lent out stops when it comes back)."""
        with self._available:
            self._closed = True
            free, self._free = self._free, []
            self._available.notify_all()
        for pool in free:
            pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_shared: dict[int, ToolRunner] = {}
_shared_lock = threading.Lock()


def shared_runner(max_workers: int = 4) -> ToolRunner:
    """One runner per process (the first call sets its size): what environments use by default."""
    with _shared_lock:
        runner = _shared.get(os.getpid())
        if runner is None or runner._closed:
            runner = _shared[os.getpid()] = ToolRunner(max_workers)
        return runner


@atexit.register
def _close_shared():
    for runner in _shared.values():
        runner.close()

