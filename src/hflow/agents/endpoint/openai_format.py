"""The OpenAI wire format, both ways: a request's messages as hflow's, a model turn as an
assistant message (its hermes `<tool_call>` blocks as `tool_calls`), and the response bodies.

Only what the official client and the agent libraries built on it send and read is handled;
anything hflow does not do (n > 1, a logit bias) is refused with a 400 naming it, so that an
agent never trains on a request that was silently served some other way. A streamed request is
answered with the whole response as server-sent events (a turn is recorded whole either way).
"""
from __future__ import annotations

import json
import re
import time
from typing import Optional

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# request fields the rollout decides (its temperature, top_p, seed): a client's values are ignored,
# so that the log-probs recorded are the ones the trainer recomputes
IGNORED_FIELDS = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty", "user", "metadata",
                  "parallel_tool_calls", "tool_choice", "store", "stream_options", "logprobs", "top_logprobs",
                  "response_format", "reasoning_effort", "service_tier", "extra_body", "model", "stop")
REFUSED_FIELDS = {"logit_bias": "a logit bias", "n": "more than one choice (n > 1)",
                  "best_of": "best_of", "echo": "echo", "suffix": "a suffix", "audio": "audio",
                  "modalities": "modalities other than text", "prediction": "predicted outputs"}


class RequestError(ValueError):
    """A request hflow cannot serve as asked: answered with this status and message."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


def error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def refused_fields(body: dict) -> None:
    """A RequestError for the first field hflow does not serve (left out, null or off is fine)."""
    for key, what in REFUSED_FIELDS.items():
        value = body.get(key)
        off = value in (None, 1) if key in ("n", "best_of") else value in (None, False, "", [], {})
        if not off:
            raise RequestError(f"hflow's endpoint does not serve {what} ({key}={value!r})", code="unsupported")


def max_tokens_of(body: dict) -> Optional[int]:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, got {value!r}")
    return value


def content_text(content) -> str:
    """A message's content as text: a string, None (an assistant turn of tool calls only), or a
    list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"a content part hflow cannot read (text parts only): {str(part)[:80]}")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"a message's content is text or a list of text parts, not {type(content).__name__}")


def chat_messages(body: dict) -> list[dict]:
    """The request's messages, each with a role and its content as text (tool messages keep
    their name and tool_call_id; assistant messages their tool calls, normalised)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"a message is an object with a role, not {str(m)[:80]}")
        message = {"role": m["role"], "content": content_text(m.get("content"))}
        if m["role"] == "tool":
            for key in ("name", "tool_call_id"):
                if isinstance(m.get(key), str):
                    message[key] = m[key]
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_normal_call(call) for call in m["tool_calls"]]
        out.append(message)
    return out


def _normal_call(call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"a tool call is {{'function': {{'name': ..., 'arguments': ...}}}}, not {str(call)[:80]}")
    return {"name": function["name"], "arguments": _arguments(function.get("arguments"))}


def _arguments(arguments):
    """Arguments compared by value: a JSON string decoded (key order and spacing do not matter)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def same_message(sent: dict, known: dict) -> bool:
    """Whether a message the client sent back is the one the session holds: role, content (None
    and "" alike, surrounding whitespace ignored on an assistant's), tool calls by name and
    arguments (their ids are labels the client may rewrite; no template renders them)."""
    if sent["role"] != known["role"]:
        return False
    if sent["role"] == "assistant":
        return (sent["content"].strip() == known["content"].strip()
                and sent.get("tool_calls", []) == known.get("tool_calls", []))
    return sent["content"] == known["content"]


def tool_schemas(body: dict) -> Optional[list[dict]]:
    tools = body.get("tools")
    if tools in (None, []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("tools must be a list of objects")
    return tools


def assistant_message(text: str, with_tools: bool, turn: int) -> dict:
    """A model turn's text as the assistant message a client gets (and the session holds): with
    tools, each well-formed `<tool_call>{"name", "arguments"}</tool_call>` block becomes a tool
    call and leaves the content; a turn with a block that does not parse keeps its text whole
    (no calls), as the model wrote it."""
    message = {"role": "assistant", "content": text, "tool_calls": []}
    if not with_tools or "<tool_call>" not in text:
        return message
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return message
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return message
        calls.append({"name": call["name"], "arguments": _arguments(call.get("arguments", call.get("parameters", {})))})
    if "<tool_call>" in _TOOL_CALL.sub("", text):
        return message   # an unclosed block
    message["content"] = _TOOL_CALL.sub("", text).strip()
    message["tool_calls"] = calls
    return message


def wire_tool_calls(message: dict, turn: int) -> Optional[list[dict]]:
    if not message["tool_calls"]:
        return None
    return [{"id": f"call_{turn}_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                          else json.dumps(c["arguments"])}}
            for i, c in enumerate(message["tool_calls"])]


def chat_completion(session_id: str, turn: int, message: dict, finish_reason: str, prompt_ids: list[int],
                    token_ids: list[int], logprobs: list[float], tokens: list[str]) -> dict:
    """A chat.completion body. Beside OpenAI's fields: `prompt_token_ids` and each choice's
    `token_ids`, what the engine was given and sampled (vLLM's names)."""
    calls = wire_tool_calls(message, turn)
    return {
        "id": f"chatcmpl-{session_id}-{turn}", "object": "chat.completion", "created": int(time.time()),
        "model": "hflow",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": message["content"] if message["content"] or not calls else None,
                        "tool_calls": calls},
            "finish_reason": "tool_calls" if calls and finish_reason == "stop" else finish_reason,
            "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                     for t, lp in zip(tokens, logprobs)]},
            "token_ids": token_ids,
        }],
        "usage": _usage(prompt_ids, token_ids),
        "prompt_token_ids": prompt_ids,
    }


def text_completion(session_id: str, turn: int, text: str, finish_reason: str, prompt_ids: list[int],
                    token_ids: list[int], logprobs: list[float], tokens: list[str]) -> dict:
    """A text_completion body, with the same token fields as chat_completion's."""
    return {
        "id": f"cmpl-{session_id}-{turn}", "object": "text_completion", "created": int(time.time()), "model": "hflow",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                     "logprobs": {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
                                  "text_offset": None},
                     "token_ids": token_ids}],
        "usage": _usage(prompt_ids, token_ids),
        "prompt_token_ids": prompt_ids,
    }


def _usage(prompt_ids: list[int], token_ids: list[int]) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
            "total_tokens": len(prompt_ids) + len(token_ids)}


def stream_chunks(completion: dict, include_usage: bool = False) -> list[dict]:
    """A response body as the chunks a stream of it sends: the choice whole (a chat message as one
    delta, its tool calls indexed; a completion's text), then its finish reason, then (asked for
    with stream_options.include_usage) its usage. hflow's own fields ride on the first chunk."""
    chat = completion["object"] == "chat.completion"
    head = {"id": completion["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": completion["created"], "model": completion["model"]}
    choice = completion["choices"][0]
    extra = {k: completion[k] for k in ("prompt_token_ids", "hflow") if k in completion}
    if chat:
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None,
                 "token_ids": choice["token_ids"]}
        last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    else:
        first = {**choice, "finish_reason": None}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    chunks = [{**head, "choices": [first], **extra}, {**head, "choices": [last]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks
