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
other sessions; the sessions' token bookkeeping stays on the caller's thread.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Hashable
from typing import Callable, Optional, Sequence

from hflow.agents.session import AgentSession, EnvReply
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
    `limits.step_timeout_s`; `collect` hands back the results as they come."""

    def __init__(self):
        self._done: queue.Queue = queue.Queue()
        self._pending: dict[Hashable, tuple[AgentSession, float, int]] = {}   # key -> (session, deadline, ticket)
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
        self._pending[key] = (session, time.monotonic() + session.limits.step_timeout_s, ticket)
        if text is None:
            self._done.put((key, ticket, None))
            return
        # the step's timeout is kept here, by its deadline: a hung thread is simply never waited for
        threading.Thread(target=lambda: self._done.put((key, ticket, session.step_env(text))),
                         daemon=True, name="hflow-env-step").start()

    def collect(self, timeout: Optional[float] = 0.0) -> list[tuple[Hashable, Optional[list[int]]]]:
        """The sessions whose step finished (or timed out), as (key, the next request's prompt ids
        or None when its trajectory ended). Waits up to `timeout` seconds for the first (None:
        until one comes, if any is pending)."""
        results = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending and not results:
            now = time.monotonic()
            wait = min(d for _, d, _ in self._pending.values()) - now
            if deadline is not None:
                wait = min(wait, deadline - now)
            try:
                item = self._done.get(timeout=max(0.0, wait))
            except queue.Empty:
                item = None
            while item is not None:
                results.extend(self._finish(*item))
                try:
                    item = self._done.get_nowait()
                except queue.Empty:
                    item = None
            results.extend(self._expire())
            if deadline is not None and time.monotonic() >= deadline:
                break
        return results

    def _finish(self, key, ticket, reply: Optional[EnvReply]) -> list:
        entry = self._pending.get(key)
        if entry is None or entry[2] != ticket:
            return []   # a step that had already timed out
        session = self._pending.pop(key)[0]
        return [(key, None if reply is None else session.end_turn(reply))]

    def _expire(self) -> list:
        now = time.monotonic()
        late = [k for k, (_, d, _) in self._pending.items() if d <= now]
        out = []
        for key in late:
            session = self._pending.pop(key)[0]
            limit = session.limits.step_timeout_s
            out.append((key, session.end_turn(EnvReply(failure=(ENV_TIMEOUT, f"no answer within {limit:g}s")))))
        return out
