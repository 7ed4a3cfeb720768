"""One trajectory as a state machine that any generation loop can drive, a turn at a time.

    session = AgentSession(env, renderer, row, limits)
    ids = session.token_ids()                              # None of it is ever re-tokenised
    while ids is not None:
        turn = generate(ids, max_tokens=session.max_new_tokens())   # e.g. LLM.add_request + step
        ids = session.on_model_turn(turn.token_ids, turn.logprobs)
    session.trajectory                                     # tokens, mask, log-probs, rewards, end

Each turn's request is the whole stream so far, so an engine with prefix caching pays only for
the new tokens. `on_model_turn` runs the environment's step on a thread under
`limits.step_timeout_s`; a loop with many sessions in flight splits it in two (`begin_turn` on
its own thread of control, the step wherever it likes, `end_turn` back on it: turns.TurnRunner
does that), so the tokenizer is only ever used from the caller's thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hflow.agents.environment import AgentFailure, Environment, StepResult, step_result_problem
from hflow.agents.limits import AgentLimits
from hflow.agents.render import Renderer
from hflow.agents.step_clock import StepClock, run_on
from hflow.agents.trajectory import (DONE, ENV_ERROR, ENV_TIMEOUT, MAX_TOKENS, MAX_TURN_TOKENS, MAX_TURNS,
                                     NO_END_OF_TURN, Trajectory)


@dataclass(frozen=True)
class EnvReply:
    """How an environment call came out: its result, or the failure that ends the trajectory."""
    result: object = None
    failure: Optional[tuple[str, str]] = None   # (finish reason, what happened)


def guarded(fn: Callable, *args) -> EnvReply:
    """Call user code; whatever it raises becomes a failure (AgentFailure names its own reason)."""
    try:
        return EnvReply(fn(*args))
    except AgentFailure as e:
        return EnvReply(failure=(e.reason, str(e)[:500]))
    except Exception as e:  # a user's environment may raise anything: it costs one trajectory
        return EnvReply(failure=(ENV_ERROR, f"{type(e).__name__}: {e}"[:500]))


def call_with_timeout(fn: Callable[..., EnvReply], args: tuple, timeout_s: float) -> EnvReply:
    """fn(*args), which catches its own failures (guarded, step_env), on a daemon thread, given
    `timeout_s` of its own time (step_clock: its tool calls' waits for a worker left out). Python
    cannot stop a thread: one that outlives the timeout is left to finish (or hang) on its own,
    and the trajectory ends as env_timeout."""
    box: list[EnvReply] = []
    clock = StepClock()
    thread = threading.Thread(target=lambda: box.append(run_on(clock, fn, *args)), daemon=True,
                              name="hflow-env-step")
    thread.start()
    # the clock stands still while the step waits for a worker, so waiting for what is left of its
    # time never passes its deadline; then look again (the floor: no spinning near the deadline)
    while thread.is_alive() and (left := timeout_s - clock.elapsed()) > 0:
        thread.join(max(left, 0.01))
    return box[0] if box else EnvReply(failure=(ENV_TIMEOUT, f"no answer within {timeout_s:g}s"))


class AgentSession:
    def __init__(self, env: Environment, renderer: Renderer, row: dict, limits: AgentLimits = AgentLimits()):
        self.env, self.renderer, self.limits = env, renderer, limits
        self.trajectory = Trajectory(prompt_ids=[])
        self._awaiting = "model"            # then "env" between begin_turn and end_turn
        self._turn_can_continue = False
        env.limits = limits
        reply = call_with_timeout(guarded, (env.reset, row), limits.step_timeout_s)
        if reply.failure:
            self.trajectory.finish(*reply.failure, failed=True)
            return
        try:
            self.trajectory.prompt_ids = self.renderer.prompt_ids(reply.result)
        except Exception as e:  # an observation that is not messages or text, or that the template refuses
            self.trajectory.finish(ENV_ERROR, f"the first observation does not render: {type(e).__name__}: {e}"[:500])
            return
        if not self.trajectory.prompt_ids:
            self.trajectory.finish(ENV_ERROR, "the first observation renders to no tokens")

    # ---- for the generation loop

    @property
    def finished(self) -> bool:
        return self.trajectory.finished

    def token_ids(self) -> list[int]:
        """The prompt of the next turn's request: everything so far."""
        return self.trajectory.token_ids()

    def max_new_tokens(self) -> int:
        """The next turn's max_tokens: a turn given more is refused."""
        return self.limits.turn_budget(len(self.trajectory.response_ids()))

    def on_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Optional[list[int]]:
        """Record a sampled turn, step the environment, append its observation. Returns the next
        request's prompt ids, or None when the trajectory has ended."""
        text = self.begin_turn(token_ids, logprobs)
        if text is None:
            return None
        return self.end_turn(call_with_timeout(self.step_env, (text,), self.limits.step_timeout_s))

    # ---- the same in two halves

    def begin_turn(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Optional[str]:
        """Record a sampled turn (the engine's tokens and log-probs, its stop token included).
        Returns the text for the environment's step, or None when the turn ended the trajectory."""
        if self.finished or self._awaiting != "model":
            raise RuntimeError("this session is not waiting for a model turn"
                               + (f" (it ended: {self.trajectory.finish_reason})" if self.finished else ""))
        budget = self.max_new_tokens()
        if len(token_ids) > budget:
            raise ValueError(f"a turn of {len(token_ids)} tokens: the session gave it max_new_tokens={budget}")
        ids = list(token_ids)
        self.trajectory.add_model_turn(ids, logprobs, self.renderer.model_text(ids))
        self._turn_can_continue = ids[-1] == self.renderer.end_of_turn_id
        if not self._turn_can_continue and len(ids) == budget:
            # cut short by its max_tokens: half a tool call is not worth running
            left = self.limits.max_response_tokens - len(self.trajectory.response_ids())
            self.trajectory.finish(MAX_TOKENS if left == 0 else MAX_TURN_TOKENS)
            return None
        self._awaiting = "env"
        return self.trajectory.model_texts[-1]

    def step_env(self, text: str) -> EnvReply:
        """The environment's step on a turn's text, failures caught; touches only the environment,
        so it may run on any thread."""
        reply = guarded(self.env.step, text)
        if reply.failure is None:
            problem = step_result_problem(reply.result)
            if problem:
                return EnvReply(failure=(ENV_ERROR, problem))
        return reply

    def end_turn(self, reply: EnvReply) -> Optional[list[int]]:
        """Take the environment's reply to the turn begun last. Returns the next request's
        prompt ids, or None when the trajectory has ended."""
        if self._awaiting != "env":
            raise RuntimeError("end_turn without a turn begun (begin_turn)")
        self._awaiting = "model"
        t = self.trajectory
        if reply.failure:
            t.finish(*reply.failure, failed=True)
            return None
        result: StepResult = reply.result
        t.turn_rewards.append(float(result.reward))
        t.counts.update({k: v for k, v in result.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if result.done:
            t.finish(DONE)
        elif not self._turn_can_continue:
            t.finish(NO_END_OF_TURN)
        elif t.num_turns >= self.limits.max_turns:
            t.finish(MAX_TURNS)
        if t.finished:
            return None
        try:
            observation, cut = self.renderer.truncate(result.observation, self.limits.max_observation_tokens)
            ids = self.renderer.observation_ids(observation)
        except Exception as e:  # not messages or text, or messages the template refuses
            t.finish(ENV_ERROR, f"the observation does not render: {type(e).__name__}: {e}"[:500])
            return None
        if cut:
            t.counts["truncated_observations"] += cut
        if len(t.response_ids()) + len(ids) >= self.limits.max_response_tokens:
            t.finish(MAX_TOKENS)   # no room left for the model to answer it
            return None
        t.add_observation(ids)
        return self.token_ids()
