"""A step's own time: what an environment step's timeout counts.

`limits.step_timeout_s` is for the step's own work, its tool calls' running included. The time
a tool call spends waiting for a tool worker (queued behind other trajectories' calls, or for a
fresh worker to start and import the tool) is the pool's doing, not the step's or the policy's,
and is left out, as it is left out of the call's own `tool_timeout_s`. So a StepClock reads the
wall time since its step began less those waits. The thread that runs a step runs it on its
clock (`run_on`); the tool runner stops the clock while that thread's call waits for a worker
(`waiting_for_a_worker`). A tool called from another thread the step started is not waited
for on the step's clock (its waits count), unless that thread runs on the clock too.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Callable, Iterator, Optional


class StepClock:
    def __init__(self, on_resume: Optional[Callable[[], None]] = None):
        """`on_resume` is called when the clock runs again after a wait: whoever sleeps until the
        step's deadline must then look again."""
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._waited = 0.0      # the waits that ended
        self._waits = 0         # the waits going on (nested or on several threads of the step)
        self._wait_began = 0.0
        self._on_resume = on_resume

    @property
    def waiting(self) -> bool:
        """Stopped: a call of the step is waiting for a worker."""
        return self._waits > 0

    def elapsed(self) -> float:
        """Seconds the step has run, its waits for a worker left out."""
        with self._lock:
            now = time.monotonic()
            waiting_now = now - self._wait_began if self._waits else 0.0
            return now - self._started - self._waited - waiting_now

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        with self._lock:
            if not self._waits:
                self._wait_began = time.monotonic()
            self._waits += 1
        try:
            yield
        finally:
            with self._lock:
                self._waits -= 1
                resumed = not self._waits
                if resumed:
                    self._waited += time.monotonic() - self._wait_began
            if resumed and self._on_resume is not None:
                self._on_resume()


_current: contextvars.ContextVar[Optional[StepClock]] = contextvars.ContextVar("hflow_step_clock", default=None)


def run_on(clock: StepClock, fn: Callable, *args):
    """fn(*args) with `clock` as the current step's clock."""
    token = _current.set(clock)
    try:
        return fn(*args)
    finally:
        _current.reset(token)


@contextlib.contextmanager
def waiting_for_a_worker() -> Iterator[None]:
    """The current step's clock (if any) stopped for the duration."""
    clock = _current.get()
    if clock is None:
        yield
        return
    with clock.stopped():
        yield
