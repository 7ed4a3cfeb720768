"""Driving sessions: one at a time with a generate function, or many in flight beside an engine.

    turns = TurnRunner()
    for key, s in sessions.items():
        llm.add_request(s.token_ids(), SamplingParams(max_tokens=s.max_new_tokens()), request_id=key)
    while llm.has_unfinished() or turns.pending:
        for out in llm.step():                  # turns that ended in this engine step
            c = out.outputs[0]
            turns.submit(out.request_id, sessions[out.request_id], c.token_ids, c.logprobs)
        for key, ids in turns.collect(timeout=0 if llm.has_unfinished() else None):
            if ids is not None:                 # the next turn: the whole stream, its prefix cached
                s = sessions[key]
                llm.add_request(ids, SamplingParams(max_tokens=s.max_new_tokens()), request_id=key)

The environments' steps (their tool calls) run on threads while the engine keeps stepping the
other sessions; the sessions' token bookkeeping stays on the caller's thread. A step's timeout
counts the step's own time (agents.step_clock): not the time its tool calls wait for a tool
worker, so that hundreds of trajectories sharing a few workers do not time out for want of one.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Hashable
from typing import Callable, Optional, Sequence

from hflow.agents.session import AgentSession, EnvReply
from hflow.agents.step_clock import StepClock, run_on
from hflow.agents.trajectory import ENV_TIMEOUT, Trajectory

Generate = Callable[[list[int], int], tuple[Sequence[int], Sequence[float]]]


def run_episode(session: AgentSession, generate: Generate) -> Trajectory:
    """Drive one session to its end; `generate(prompt_ids, max_new_tokens)` returns a turn's
    sampled token ids (its stop token included) and their log-probs."""
    ids = None if session.finished else session.token_ids()
    while ids is not None:
        token_ids, logprobs = generate(ids, session.max_new_tokens())
        ids = session.on_model_turn(token_ids, logprobs)
    return session.trajectory


class TurnRunner:
    """Steps many sessions' environments at once, each on its own thread under the session's
    `limits.step_timeout_s` of its own time (its tool calls' waits for a worker left out);
    `collect` hands back the results as they come."""

    def __init__(self):
        self._done: queue.Queue = queue.Queue()   # (key, ticket, reply), or None: a clock runs again
        self._pending: dict[Hashable, tuple[AgentSession, StepClock, int]] = {}   # key -> (session, clock, ticket)
        self._tickets = itertools.count()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, key: Hashable, session: AgentSession, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Record a sampled turn and start its environment step (or, when the turn ended the
        trajectory, queue that for the next collect)."""
        if key in self._pending:
            raise ValueError(f"session {key!r} already has a turn in flight")
        text = session.begin_turn(token_ids, logprobs)
        ticket = next(self._tickets)
        # a clock that runs again after a wait wakes collect, which does not count on it while it waits
        clock = StepClock(on_resume=lambda: self._done.put(None))
        self._pending[key] = (session, clock, ticket)
        if text is None:
            self._done.put((key, ticket, None))
            return
        # the step's timeout is kept here, on its clock: a hung thread is simply never waited for
        threading.Thread(target=lambda: self._done.put((key, ticket, run_on(clock, session.step_env, text))),
                         daemon=True, name="hflow-env-step").start()

    def collect(self, timeout: Optional[float] = 0.0) -> list[tuple[Hashable, Optional[list[int]]]]:
        """The sessions whose step finished (or timed out), as (key, the next request's prompt ids
        or None when its trajectory ended). Waits up to `timeout` seconds for the first (None:
        until one comes, if any is pending)."""
        results = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending and not results:
            wait = self._time_left()
            if deadline is not None:
                left = deadline - time.monotonic()
                wait = left if wait is None else min(wait, left)
            try:
                item = self._done.get(timeout=None if wait is None else max(0.0, wait))
            except queue.Empty:
                item = None
            while True:
                if item is not None:
                    results.extend(self._finish(*item))
                try:
                    item = self._done.get_nowait()
                except queue.Empty:
                    break
            results.extend(self._expire())
            if deadline is not None and time.monotonic() >= deadline:
                break
        return results

    def _time_left(self) -> Optional[float]:
        """Until the first running step's deadline; None when every step waits for a worker (its
        clock stopped: it wakes collect when it runs again)."""
        left = [s.limits.step_timeout_s - clock.elapsed() for s, clock, _ in self._pending.values()
                if not clock.waiting]
        return min(left) if left else None

    def _finish(self, key, ticket, reply: Optional[EnvReply]) -> list:
        entry = self._pending.get(key)
        if entry is None or entry[2] != ticket:
            return []   # a step that had already timed out
        session = self._pending.pop(key)[0]
        return [(key, None if reply is None else session.end_turn(reply))]

    def _expire(self) -> list:
        late = [k for k, (s, clock, _) in self._pending.items() if clock.elapsed() >= s.limits.step_timeout_s]
        out = []
        for key in late:
            session = self._pending.pop(key)[0]
            limit = session.limits.step_timeout_s
            out.append((key, session.end_turn(EnvReply(failure=(ENV_TIMEOUT, f"no answer within {limit:g}s")))))
        return out
