"""Multi-turn rollouts of agents written against the OpenAI client, on an actor rank (issue 45).

    batch = sample_agent(llm, rows, "file.py:solve", rollout, limits, tokenizer, pad_id, mesh)   # agent_rollout's

For the rollout, this rank serves its engine on loopback (agents.endpoint: an ASGI app under
uvicorn), and runs `solve(row, base_url)` for every (row, sample) on a thread of its own, each
with the base_url of its own session. This thread drives the engine: a request that comes in is
checked against its session's recording (agents.endpoint.conversation), queued on the engine with
the whole recorded stream as its prompt (the prefix cache spares the earlier turns' KV), and
answered when the engine finishes it; the engine keeps decoding the other sessions' turns
meanwhile. When every agent has returned, each session's recording is one trajectory, scored by
what its agent returned, in the batch layout of agent_rollout.sample_agent.

An agent's own time (from a turn's answer to its next turn's request, or to its return; a refused
request does not restart it) is bounded by `limits.step_timeout_s`, like an environment's step: past it the trajectory ends as env_timeout
and the agent's thread is left to finish on its own. An agent that raises ends its trajectory as
env_error, unless the session had already ended by a limit (max_turns, max_tokens), which an
agent may well not expect: then the limit is how it ended.

Seeds: a turn's seed is derived from (rollout.seed, global row, sample, request), as for
environments, so the same agent code gives the same trajectories on any number of ranks.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import Future
from bisect import bisect_right
from typing import Callable, Optional

import torch

from hflow.agents import AgentLimits, Trajectory
from hflow.agents.endpoint.agent_function import call_agent
from hflow.agents.endpoint.app import build_app
from hflow.agents.endpoint.conversation import PREFIX_MISMATCH, EndpointSession, PendingTurn, Renderers
from hflow.agents.endpoint.openai_format import RequestError, error_body
from hflow.agents.endpoint.server import LoopbackServer
from hflow.agents.render import TemplateError
from hflow.agents.trajectory import DONE, ENV_ERROR, ENV_TIMEOUT
from hflow.engine import LLM, SamplingParams
from hflow.workers.rollout_batches import OFFER_POLL_S, RolloutConfig, turn_seed


class EndpointDriver:
    """Sessions by id, the engine, and one queue of events from the other threads: a request
    from the HTTP server, or an agent's return."""

    def __init__(self, llm: LLM, sessions: dict[str, EndpointSession], keys: dict[str, tuple], rollout: RolloutConfig,
                 stop_ids: list[int], version: Optional[Callable[[], int]] = None,
                 between_steps: Optional[Callable[[], None]] = None):
        self.llm, self.sessions, self.keys, self.rollout, self.stop_ids = llm, sessions, keys, rollout, stop_ids
        self.version, self.between_steps = version, between_steps
        self.queued_at: dict[tuple, int] = {}          # request -> the policy version when it was queued
        self.events: queue.Queue = queue.Queue()
        self.in_flight: dict[tuple, tuple[EndpointSession, PendingTurn, Future]] = {}
        self.requests: Counter = Counter()            # per session: requests queued on the engine
        self.prefill_total: Counter = Counter()
        self.prefill_computed: Counter = Counter()
        self.outcomes: dict[str, tuple[str, object]] = {}   # session -> ("reward", r) / ("error", text) / ("timeout", s)

    # ---- from the server's thread

    def submit(self, session_id: str, route: str, body: dict) -> Future:
        future: Future = Future()
        self.events.put(("request", session_id, route, body, future))
        return future

    # ---- on this thread

    def run(self, start_agent: Callable[[str], Callable[[], object]]) -> None:
        """Start every session's agent (start_agent(id) -> the call to run on its thread) and
        drive the engine until each has returned or run out of time."""
        for sid in self.sessions:
            self._start(sid, start_agent(sid))
        try:
            while len(self.outcomes) < len(self.sessions) or self.in_flight:
                busy = self.llm.has_unfinished()
                # idle: wait for a request, a return or a deadline (and, in a partial rollout, look
                # for offered weights every OFFER_POLL_S, as run_sessions does)
                wait = self._time_to_next_deadline()
                if self.between_steps is not None:
                    wait = min(wait, OFFER_POLL_S)
                self._take_events(wait=0.0 if busy else wait)
                if self.llm.has_unfinished():
                    for out in self.llm.step():
                        c = out.outputs[0]
                        self.prefill_computed[out.request_id[0]] += len(out.prompt_token_ids) - out.num_cached_tokens
                        self._answer(out.request_id, c)
                if self.between_steps is not None:
                    self.between_steps()
                self._expire()
        except BaseException:
            for request_id, (_, _, future) in self.in_flight.items():
                try:
                    self.llm.abort(request_id)
                except KeyError:
                    pass
                future.set_result((500, error_body("hflow's rollout failed", "internal_error")))
            raise

    def _start(self, sid: str, call: Callable[[], object]) -> None:
        def agent():
            try:
                self.events.put(("returned", sid, ("reward", call())))
            except BaseException as e:  # the agent's own failure costs its trajectory, never the rollout
                self.events.put(("returned", sid, ("error", f"{type(e).__name__}: {e}"[:500])))
        self.sessions[sid].last_answered = time.monotonic()
        threading.Thread(target=agent, daemon=True, name=f"hflow-agent-{sid}").start()

    def _take_events(self, wait: float) -> None:
        try:
            event = self.events.get(timeout=wait) if wait > 0 else self.events.get_nowait()
        except queue.Empty:
            return
        while True:
            if event[0] == "request":
                self._request(*event[1:])
            elif event[1] not in self.outcomes:   # not already timed out
                self.outcomes[event[1]] = event[2]
                self._drop_in_flight(event[1])
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return

    def _request(self, sid: str, route: str, body: dict, future: Future) -> None:
        session = self.sessions.get(sid)
        if session is None:
            future.set_result((404, error_body(f"no session {sid!r} in this rollout", "unknown_session")))
            return
        if sid in self.outcomes:
            future.set_result((400, error_body("this session's agent has returned or run out of time",
                                               "session_ended")))
            return
        if session.in_flight:
            future.set_result((409, error_body("one request at a time in a session: a trajectory is one stream",
                                               "concurrent_request")))
            return
        try:
            if route == "tokenize":   # no engine work: answered here and now
                future.set_result((200, session.tokenize(body)))
                return
            turn = session.chat_request(body) if route == "chat" else session.completion_request(body)
            request_id = (sid, self.requests[sid])
            params = SamplingParams(n=1, temperature=self.rollout.temperature, top_p=self.rollout.top_p,
                                    top_k=self.rollout.top_k, max_tokens=turn.max_tokens,
                                    stop_token_ids=self.stop_ids,
                                    seed=turn_seed(self.rollout.seed, *self.keys[sid], self.requests[sid]))
            self.llm.add_request(turn.prompt_ids, params, request_id=request_id)
        except RequestError as e:
            self._refuse(session, future, e.status, error_body(str(e), e.code))
            return
        except ValueError as e:   # the engine refused it (too long for its KV budget)
            self._refuse(session, future, 400, error_body(str(e), "engine_refused"))
            return
        self.requests[sid] += 1
        self.prefill_total[sid] += len(turn.prompt_ids)
        if self.version is not None:
            self.queued_at[request_id] = self.version()
        session.in_flight = True
        self.in_flight[request_id] = (session, turn, future)

    @staticmethod
    def _refuse(session: EndpointSession, future: Future, status: int, body: dict) -> None:
        # the agent's own time goes on: only a turn restarts it, so that an agent retrying a refused
        # request (or one its ended session refuses) for ever is stopped by its timeout
        future.set_result((status, body))

    def _answer(self, request_id, output) -> None:
        session, turn, future = self.in_flight.pop(request_id)
        session.in_flight = False
        session.last_answered = time.monotonic()
        try:
            body = session.answer(turn, output.token_ids, output.logprobs)
            if self.version is not None and turn.recorded:   # the turn just recorded: its tokens' versions
                first, changes = self.queued_at.pop(request_id), sorted(output.weight_changes)
                session.trajectory.segments[-1].policy_versions = [
                    first + bisect_right(changes, t) for t in range(len(output.token_ids))]
            future.set_result((200, body))
        except Exception as e:
            traceback.print_exc()
            future.set_result((500, error_body(f"hflow could not answer: {type(e).__name__}: {e}", "internal_error")))

    def _time_to_next_deadline(self) -> float:
        waiting = [s.last_answered for sid, s in self.sessions.items() if sid not in self.outcomes and not s.in_flight]
        if not waiting:
            return 0.5
        limit = next(iter(self.sessions.values())).limits.step_timeout_s
        return min(0.5, max(0.001, min(waiting) + limit - time.monotonic()))

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, s in self.sessions.items():
            if sid not in self.outcomes and not s.in_flight and now - s.last_answered >= s.limits.step_timeout_s:
                self.outcomes[sid] = ("timeout", s.limits.step_timeout_s)

    def _drop_in_flight(self, sid: str) -> None:
        """An agent returned with a request of its still on the engine (it did not wait for it)."""
        for request_id in [r for r in self.in_flight if r[0] == sid]:
            session, _, future = self.in_flight.pop(request_id)
            session.in_flight = False
            self.llm.abort(request_id)
            future.set_result((400, error_body("the agent returned", "session_ended")))


def finished_trajectory(session: EndpointSession, outcome: tuple[str, object]) -> Trajectory:
    """A session's recording, ended as its agent's return says: its reward on the last turn, the
    limit that ended the recording as its finish. An agent that raised or ran out of time fails
    its trajectory (reward 0), unless it had been told its session was over: then the limit ends it."""
    t, (kind, value) = session.trajectory, outcome
    if kind != "reward" and not session.told_ended:
        if kind == "timeout":
            t.finish(ENV_TIMEOUT, f"the agent made no request and did not return within {value:g}s", failed=True)
        else:
            t.finish(ENV_ERROR, f"the agent raised {value}", failed=True)
        return t
    if not t.num_turns:
        t.finish(ENV_ERROR, "the agent returned without a request", failed=True)
        return t
    if kind == "reward":
        reward, counts = value
        if isinstance(reward, list):
            if len(reward) != t.num_turns:
                t.finish(ENV_ERROR, f"the agent returned {len(reward)} turn_rewards for {t.num_turns} recorded turns",
                         failed=True)
                return t
            t.turn_rewards = reward
        else:
            t.turn_rewards = [0.0] * (t.num_turns - 1) + [reward]
        t.counts.update(counts)
    if session.diverged:
        t.finish(PREFIX_MISMATCH, session.mismatch)
    else:
        t.finish(session.ended or DONE)
    return t


def end_of_turn_ids(tokenizer, renderers: Renderers) -> list[int]:
    """The chat template's end-of-turn token, if the tokenizer has a template that has one."""
    try:
        return [renderers.get(None, None).end_of_turn_id]
    except (RequestError, TemplateError):
        return []


def serve_parts(llm, parts: list[tuple[int, list[dict]]], agent_fn: Callable, rollout: RolloutConfig,
                limits: AgentLimits, tokenizer, version: Optional[Callable[[], int]] = None,
                between_steps: Optional[Callable[[], None]] = None) -> list[list[tuple]]:
    """agent_rollout.run_parts for an agent function: every part's (its first global row, its
    rows' dicts) `rollout.n` calls of `agent_fn(row, base_url)`, served from one engine (an LLM
    or a LockstepEngine). Per part, per (row, sample) in order: (trajectory, prompt tokens its
    requests carried, those computed)."""
    renderers = Renderers(tokenizer)
    stop_ids = sorted({*llm.eos_token_ids, *end_of_turn_ids(tokenizer, renderers)})
    keys, rows_of = {}, {}
    for offset, dicts in parts:
        for i, row in enumerate(dicts):
            for j in range(rollout.n):
                keys[f"{offset + i}-{j}"], rows_of[f"{offset + i}-{j}"] = (offset + i, j), row
    sessions = {sid: EndpointSession(sid, tokenizer, renderers, limits, stop_ids, llm.max_model_len) for sid in keys}
    driver = EndpointDriver(llm, sessions, keys, rollout, stop_ids, version, between_steps)
    with LoopbackServer(build_app(driver.submit)) as server:
        def start_agent(sid):
            row, url = dict(rows_of[sid]), f"{server.url}/sessions/{sid}/v1"
            return lambda: call_agent(agent_fn, row, url)
        driver.run(start_agent)
    return [[(finished_trajectory(sessions[f"{offset + i}-{j}"], driver.outcomes[f"{offset + i}-{j}"]),
              driver.prefill_total[f"{offset + i}-{j}"], driver.prefill_computed[f"{offset + i}-{j}"])
             for i in range(len(dicts)) for j in range(rollout.n)] for offset, dicts in parts]


def served_columns(trajs: list[Trajectory], tensors: dict) -> dict:
    """What a served rollout's batch has besides an environment's: response_mask 0 on a
    trajectory whose client broke its recorded prefix (the rule: scored, never trained on;
    agents.endpoint.conversation), and per trajectory its mismatches and unrecorded turns."""
    for i, t in enumerate(trajs):
        if t.finish_reason == PREFIX_MISMATCH:
            tensors["response_mask"][i] = 0
    return {key: torch.tensor([t.counts.get(key, 0) for t in trajs], dtype=torch.long)
            for key in ("prefix_mismatches", "unrecorded_turns")}
