"""One agent's conversation with the engine, recorded as one growing trajectory.

A client sends its whole conversation with every request; the session holds the same
conversation as it recorded it: the prompt's messages, then for each turn the assistant message
it answered with (the engine's tokens, never re-tokenised) and the messages the client added
after it (tool results, a user's reply), appended as the chat template's delta
(agents.render.ChatRenderer.observation_ids). A request extends the recording when its messages
begin with the recorded ones, the client's additions hold no assistant message, and its tools
and template arguments are the first request's: only then is its turn recorded.

The rule for a request that does not extend it (an edited history, a template that rewrites
earlier turns, a tool list that changed): the turn is served from the client's own messages
rendered afresh, so the agent goes on, but it is not recorded; the session counts it
(`prefix_mismatches`) and ends as `prefix_mismatch`. Such a trajectory keeps its reward (it
was sampled from the policy, and its group's baseline counts it), but none of its tokens are
trained on: what the policy saw after the break is not a prefix of one recorded stream.

The token route (/v1/completions with token ids) follows the same rule on ids: a request
extends the recording when its prompt begins with every token recorded so far.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

from hflow.agents.endpoint.openai_format import (RequestError, assistant_message, chat_completion, chat_messages,
                                                 max_tokens_of, refused_fields, same_message, text_completion,
                                                 tool_schemas)
from hflow.agents.limits import AgentLimits
from hflow.agents.render import ChatRenderer, TemplateError
from hflow.agents.trajectory import MAX_TOKENS, MAX_TURN_TOKENS, MAX_TURNS, NO_END_OF_TURN, Trajectory

PREFIX_MISMATCH = "prefix_mismatch"   # a finish reason: scored, counted in its group, never trained on


class SessionEnded(RequestError):
    """Said to a client whose session a limit has ended (max_turns, max_tokens, a cut turn)."""

    def __init__(self, reason: str):
        super().__init__(f"this session has ended ({reason}): hflow records no more turns for it", status=400,
                         code="session_ended")


@dataclass
class PendingTurn:
    """A request turned into an engine request, and how its answer is to be written back."""
    prompt_ids: list[int]
    max_tokens: int
    route: str                  # "chat" or "completion"
    recorded: bool              # False: served from the client's own messages, past a mismatch
    with_tools: bool = False


class Renderers:
    """One ChatRenderer per (tools, template arguments) a client asks for, built once (each checks
    that its template extends a stream exactly)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._made: dict[str, ChatRenderer] = {}

    def get(self, tools: Optional[list[dict]], template_kwargs: Optional[dict]) -> ChatRenderer:
        key = json.dumps([tools, template_kwargs], sort_keys=True)
        if key not in self._made:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("the model's tokenizer has no chat template: send token ids to /v1/completions")
            try:
                self._made[key] = ChatRenderer(self.tokenizer, tools=tools, template_kwargs=template_kwargs)
            except TemplateError as e:
                raise RequestError(f"the chat template cannot record this conversation exactly: {e}") from None
        return self._made[key]


class EndpointSession:
    def __init__(self, session_id: str, tokenizer, renderers: Renderers, limits: AgentLimits, stop_ids: list[int],
                 max_model_len: int):
        self.id, self.tokenizer, self.renderers, self.limits = session_id, tokenizer, renderers, limits
        self.stop_ids, self.max_model_len = set(stop_ids), max_model_len
        self.trajectory = Trajectory(prompt_ids=[])
        self.known: Optional[list[dict]] = None      # the conversation as recorded (chat route)
        self.chat_options = None                     # the first chat request's (tools, template kwargs)
        self.renderer: Optional[ChatRenderer] = None
        self.diverged = False
        self.ended: Optional[str] = None             # the limit that ended the recording (the trajectory's finish)
        self.told_ended = False                      # the client was answered SessionEnded
        self.mismatch: Optional[str] = None          # what the first mismatch was
        self.can_extend = True                       # the last turn ended with the end-of-turn token
        self.in_flight = False
        self.last_answered = time.monotonic()        # the agent's own time runs from here

    # ---- requests

    def chat_request(self, body: dict) -> PendingTurn:
        refused_fields(body)
        messages = chat_messages(body)
        tools, kwargs = tool_schemas(body), body.get("chat_template_kwargs") or None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        renderer = self.renderers.get(tools, kwargs)
        client_max = max_tokens_of(body)
        if not self.diverged:
            problem = self._extension_problem(messages, (tools, kwargs))
            if problem is None:
                return self._recorded_chat(messages, renderer, (tools, kwargs), client_max)
            self._diverge(problem)
        ids = self._render(renderer.prompt_ids, messages)
        return self._unrecorded(ids, client_max, "chat", with_tools=tools is not None)

    def completion_request(self, body: dict) -> PendingTurn:
        refused_fields(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=not self.trajectory.prompt_ids))
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be token ids (a list of integers) or text")
        client_max = max_tokens_of(body)
        if not self.diverged:
            recorded = self.trajectory.token_ids()
            if not recorded:
                self._start(ids)
                self.known = None
                return PendingTurn(ids, self._budget(client_max), "completion", recorded=True)
            if ids[:len(recorded)] == recorded:
                self._before_turn()
                self.known = None   # the conversation is now the client's tokens; a chat request would not extend it
                self._observe(ids[len(recorded):])
                return PendingTurn(self.trajectory.token_ids(), self._budget(client_max), "completion", recorded=True)
            self._diverge("the prompt's token ids do not begin with the recorded stream")
        return self._unrecorded(ids, client_max, "completion")

    def tokenize(self, body: dict) -> dict:
        """Text as the tokens that stand for it, a special token's text included (vLLM's /tokenize
        with its special tokens off): what a token-in/token-out agent appends as an observation."""
        text = body.get("prompt")
        if not isinstance(text, str):
            raise RequestError("prompt must be text")
        ids = list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    # ---- answers

    def answer(self, turn: PendingTurn, token_ids: list[int], logprobs: list[float]) -> dict:
        """The engine's answer to `turn`, recorded (if the turn is), as the response body."""
        ids = list(token_ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        finish = "stop" if stopped else "length"
        turn_index = self.trajectory.num_turns
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        if turn.recorded:
            self._record(ids, logprobs, text, stopped, turn)
        # each token's text for the log-probs, in one call rather than one decode a token
        tokens = self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
        lps = [float(x) for x in logprobs]
        if turn.route == "completion":
            body = text_completion(self.id, turn_index, text, finish, turn.prompt_ids, ids, lps, tokens)
        else:
            message = (self.known[-1] if turn.recorded else assistant_message(text, turn.with_tools, turn_index))
            body = chat_completion(self.id, turn_index, message, finish, turn.prompt_ids, ids, lps, tokens)
        # the turn says whether it was recorded, and if not, why (the rule in the module docstring)
        body["hflow"] = {"recorded": turn.recorded, "turn": turn_index, "mismatch": self.mismatch,
                         "ended": self.ended}
        return body

    # ---- the recording

    def _recorded_chat(self, messages: list[dict], renderer: ChatRenderer, options, client_max) -> PendingTurn:
        if self.known is None:   # the first request: its messages are the prompt
            self._start(self._render(renderer.prompt_ids, messages))
            self.known, self.chat_options, self.renderer = list(messages), options, renderer
        else:
            self._before_turn()
            added = messages[len(self.known):]
            observation, cut = renderer.truncate([_renderable(m) for m in added], self.limits.max_observation_tokens)
            if cut:
                self.trajectory.counts["truncated_observations"] += cut
            self._observe(self._render(renderer.observation_ids, observation))
            self.known.extend(added)
        return PendingTurn(self.trajectory.token_ids(), self._budget(client_max), "chat", recorded=True,
                           with_tools=options[0] is not None)

    def _extension_problem(self, messages: list[dict], options) -> Optional[str]:
        """Why `messages` do not extend the recorded conversation, or None."""
        if self.known is None:
            return None if not self.trajectory.prompt_ids else "a chat request after token-id requests"
        if options != self.chat_options:
            return "the tools or chat_template_kwargs differ from the first request's"
        n = len(self.known)
        if len(messages) <= n:
            return f"{len(messages)} messages, where the recorded conversation has {n}"
        for i, (sent, known) in enumerate(zip(messages, self.known)):
            if not same_message(sent, known):
                return f"message {i} ({sent['role']}) is not the one recorded"
        if any(m["role"] == "assistant" for m in messages[n:]):
            return "the client added an assistant message of its own"
        return None

    def _start(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("the prompt renders to no tokens")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the engine's max_model_len is "
                               f"{self.max_model_len}")
        self.trajectory.prompt_ids = list(prompt_ids)

    def _before_turn(self) -> None:
        """The next turn's request has come: the session's limits end it here, or it goes on."""
        if self.ended is None and not self.can_extend:
            self.ended = NO_END_OF_TURN
        if self.ended is None and self.trajectory.num_turns >= self.limits.max_turns:
            self.ended = MAX_TURNS
        if self.ended is not None:
            self._tell_ended()

    def _tell_ended(self):
        self.told_ended = True
        raise SessionEnded(self.ended)

    def _observe(self, ids: list[int]) -> None:
        t = self.trajectory
        if len(t.response_ids()) + len(ids) >= self.limits.max_response_tokens or \
                len(t.token_ids()) + len(ids) >= self.max_model_len:
            self.ended = MAX_TOKENS   # no room left for the model to answer it
            self._tell_ended()
        t.add_observation(ids)

    def _budget(self, client_max: Optional[int]) -> int:
        budget = self.limits.turn_budget(len(self.trajectory.response_ids()))
        budget = min(budget, self.max_model_len - len(self.trajectory.token_ids()))
        return budget if client_max is None else min(budget, client_max)

    def _record(self, ids: list[int], logprobs, text: str, stopped: bool, turn: PendingTurn) -> None:
        t = self.trajectory
        t.add_model_turn(ids, logprobs, text)
        if turn.route == "chat":
            self.known.append(assistant_message(text, turn.with_tools, t.num_turns - 1))
        # a template extends only a turn that ended with its end-of-turn token; a token-route
        # client extends whatever it was given (the template, if any, is its own)
        self.can_extend = turn.route != "chat" or (stopped and ids[-1] == self.renderer.end_of_turn_id)
        if not stopped:
            left = self.limits.max_response_tokens - len(t.response_ids())
            if left <= 0 or len(t.token_ids()) >= self.max_model_len:
                self.ended = MAX_TOKENS
            elif turn.route == "chat":
                self.ended = MAX_TURN_TOKENS   # cut short: the template cannot extend a turn without its end

    def _diverge(self, problem: str) -> None:
        self.diverged, self.mismatch = True, problem
        self.trajectory.counts["prefix_mismatches"] += 1

    def _unrecorded(self, ids: list[int], client_max: Optional[int], route: str, with_tools: bool = False) -> PendingTurn:
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the engine's max_model_len is {self.max_model_len}")
        budget = self.limits.max_turn_tokens or self.limits.max_response_tokens
        budget = min(budget, self.max_model_len - len(ids))
        self.trajectory.counts["unrecorded_turns"] += 1
        return PendingTurn(ids, budget if client_max is None else min(budget, client_max), route, recorded=False,
                           with_tools=with_tools)

    @staticmethod
    def _render(fn, messages):
        try:
            return fn(messages)
        except RequestError:
            raise
        except Exception as e:   # a message the template refuses
            raise RequestError(f"the chat template could not render the messages: {type(e).__name__}: {e}"[:500]) \
                from None


def _renderable(message: dict) -> dict:
    """A client's message as the template is given it: role, content (and a tool's name)."""
    out = {"role": message["role"], "content": message["content"]}
    if message["role"] == "tool" and "name" in message:
        out["name"] = message["name"]
    return out
