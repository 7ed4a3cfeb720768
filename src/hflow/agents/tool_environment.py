"""An environment of tools: the model calls them until it answers; the answer may be scored.

    env = ToolEnvironment(["calculator"], format="tags", reward_fn="arithmetic")
    env.reset({"prompt": "27*82=", "answer": "2214"})
    env.step("<calc>27*82</calc>")    # -> StepResult([tool message "2214"], 0, done=False)
    env.step("2214")                  # -> StepResult(None, 1.0, done=True)

A turn without a tool call is the final answer: done, scored by `reward_fn` (an hflow score
function, by name or callable: `fn(answer_text, row[answer_key], **other columns)`; none: 0).
A malformed call or a tool's ToolInputError is told to the model and counted (bad_tool_calls),
or, with `end_on_bad_call`, ends the trajectory. A tool that raises or returns garbage ends it as
tool_error, one whose worker dies under it as tool_crash, one that outlives
`limits.tool_timeout_s` as tool_timeout.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from hflow.agents.environment import AgentFailure, Environment, StepResult
from hflow.agents.formats import BadCall, ToolCall, get_format
from hflow.agents.tool_calls import ToolRunner, shared_runner
from hflow.agents.tools import Tool, as_tool
from hflow.agents.trajectory import BAD_TOOL_CALL, TOOL_CRASH, TOOL_ERROR, TOOL_TIMEOUT
from hflow.rewards import get_reward_fn, score_batch


class ToolEnvironment(Environment):
    def __init__(self, tools: Sequence[Union[str, Callable, Tool]] = ("calculator",), format: str = "hermes",
                 reward_fn: Union[str, Callable, None] = None, prompt_key: str = "prompt",
                 answer_key: str = "answer", max_calls_per_turn: int = 8, end_on_bad_call: bool = False,
                 runner: Optional[ToolRunner] = None):
        self.tools = {}
        for spec in tools:
            t = as_tool(spec)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        tags = [t.tag for t in self.tools.values()]
        if len(set(tags)) != len(tags):
            raise ValueError(f"two tools share a tag: {sorted(tags)}")
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.format = get_format(format)
        self.reward_fn = get_reward_fn(reward_fn) if reward_fn else None
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.max_calls_per_turn, self.end_on_bad_call = max_calls_per_turn, end_on_bad_call
        self._runner = runner
        self.ground_truth, self.extra = None, {}

    @property
    def runner(self) -> ToolRunner:
        return self._runner or shared_runner()

    def tool_schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def reset(self, row: dict) -> Union[str, list]:
        if self.prompt_key not in row:
            raise KeyError(f"the row has no {self.prompt_key!r} column (columns: {sorted(row)})")
        self.ground_truth = row.get(self.answer_key)
        # the score function's own arguments (hflow's prompt rows carry a ground_truth) are not extras
        self.extra = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key, "ground_truth",
                                                                 "response")}
        return row[self.prompt_key]

    def step(self, text: str) -> StepResult:
        calls = self.format.parse(text, self.tools)
        if not calls:
            reward, failed = self.score(text)
            return StepResult(None, reward, done=True, info={"reward_errors": failed} if failed else {})
        messages, bad = [], 0
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                name = call.tool.name if isinstance(call, ToolCall) else call.name
                call = BadCall(f"at most {self.max_calls_per_turn} tool calls in one turn", name)
            if isinstance(call, BadCall):
                if self.end_on_bad_call:
                    raise AgentFailure(BAD_TOOL_CALL, call.problem)
                bad += 1
                result = f"error: {call.problem}"
            else:
                outcome = self.runner.call(call.tool, call.arguments, self.limits.tool_timeout_s)
                if outcome.status == "timeout":
                    raise AgentFailure(TOOL_TIMEOUT, outcome.text)
                if outcome.status == "error":
                    raise AgentFailure(TOOL_ERROR, outcome.text)
                if outcome.status == "crash":
                    raise AgentFailure(TOOL_CRASH, outcome.text)
                if outcome.status == "bad_input":
                    if self.end_on_bad_call:
                        raise AgentFailure(BAD_TOOL_CALL, outcome.text)
                    bad += 1
                    result = f"error: {outcome.text}"
                else:
                    result = outcome.text
            messages.append(self.format.result_message(call, result))
        return StepResult(messages, 0.0, done=False, info={"tool_calls": len(calls), "bad_tool_calls": bad})

    def score(self, answer: str) -> tuple[float, int]:
        """The final answer's reward and whether scoring it failed (then it is 0, as in rewards).
        A function marked inline_safe (the fast built-ins) scores here; any other in a tool
        worker, under `limits.tool_timeout_s`, queued with the tool calls: every trajectory
        scores its own answer when it ends, and rewards' shared pool, which scores one batch at
        a time, would queue them all behind one lock."""
        if self.reward_fn is None:
            return 0.0, 0
        if getattr(self.reward_fn, "inline_safe", False):
            scored = score_batch(self.reward_fn, [answer], [self.ground_truth], [self.extra], inline=True)
            return scored.scores[0], int(scored.failures[0] is not None)
        score, failure = self.runner.score(self.reward_fn, answer, self.ground_truth, self.extra,
                                           self.limits.tool_timeout_s)
        return score, int(failure is not None)
