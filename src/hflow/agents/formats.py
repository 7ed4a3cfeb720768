"""Tool-call formats: how a model's text asks for tools, and how the results go back.

- ``hermes`` (Qwen2.5, Qwen3, and the templates that copied them): ``<tool_call>{"name": ..,
  "arguments": {..}}</tool_call>``, any number per turn; each result is a ``tool`` message, which
  the chat template wraps (Qwen: ``<tool_response>``). ``"parameters"`` is read as
  ``"arguments"`` (Llama 3.1's JSON calls), and arguments given as a JSON string are decoded.
- ``tags``, for a small model without a chat template: ``<calc>27*82</calc>``, the tool's tag
  around its argument (a JSON object for a tool of several arguments); the result is a ``tool``
  message, which TextRenderer writes as ``<result>2214</result>``.

A text with no call is the model's final answer. A call that cannot be read (bad JSON, an unknown
tool, arguments that do not fit, an unclosed tag) is a BadCall: its problem goes back to the model
as the result and is counted; it never raises.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Union

from hflow.agents.tools import Tool, argument_problem

Message = dict


@dataclass(frozen=True)
class ToolCall:
    tool: Tool
    arguments: dict


@dataclass(frozen=True)
class BadCall:
    problem: str
    """Said to the model as the call's result."""
    name: Optional[str] = None


Call = Union[ToolCall, BadCall]


def _checked(tool: Optional[Tool], name, arguments, tools: dict[str, Tool]) -> Call:
    if tool is None:
        return BadCall(f"unknown tool {name!r}; the tools are {', '.join(sorted(tools)) or 'none'}",
                       name if isinstance(name, str) else None)
    problem = argument_problem(tool, arguments)
    return BadCall(problem, tool.name) if problem else ToolCall(tool, arguments)


class HermesFormat:
    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: dict[str, Tool]) -> list[Call]:
        """The calls in a model turn, in order; [] when there is none (a final answer)."""
        calls: list[Call] = [self._read(body, tools) for body in self._CALL.findall(text)]
        if "<tool_call>" in self._CALL.sub("", text):
            calls.append(BadCall("a <tool_call> was not closed with </tool_call>"))
        return calls

    @staticmethod
    def _read(body: str, tools: dict[str, Tool]) -> Call:
        try:
            call = json.loads(body)
        except ValueError as e:
            return BadCall(f"the tool call is not valid JSON ({e})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return BadCall('a tool call is a JSON object {"name": ..., "arguments": {...}}')
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return BadCall(f"the arguments of {call['name']} are not a JSON object", call["name"])
        return _checked(tools.get(call["name"]), call["name"], arguments, tools)

    def result_message(self, call: Call, text: str) -> Message:
        message = {"role": "tool", "content": text}
        name = call.tool.name if isinstance(call, ToolCall) else call.name
        if name:
            message["name"] = name
        return message


class TagsFormat:
    name = "tags"

    def parse(self, text: str, tools: dict[str, Tool]) -> list[Call]:
        by_tag = {t.tag: t for t in tools.values()}
        if not by_tag:
            return []
        tags = "|".join(re.escape(tag) for tag in sorted(by_tag, key=len, reverse=True))
        closed = re.compile(rf"<({tags})>(.*?)</\1>", re.DOTALL)
        calls: list[Call] = [self._read(by_tag[tag], body, tools) for tag, body in closed.findall(text)]
        unclosed = re.search(rf"<({tags})>", closed.sub("", text))
        if unclosed:
            calls.append(BadCall(f"<{unclosed.group(1)}> was not closed with </{unclosed.group(1)}>",
                                 by_tag[unclosed.group(1)].name))
        return calls

    @staticmethod
    def _read(tool: Tool, body: str, tools: dict[str, Tool]) -> Call:
        properties = tool.parameters.get("properties", {})
        if len(properties) == 1:
            (only, schema), = properties.items()
            if schema.get("type") == "string":
                return _checked(tool, tool.name, {only: body.strip("\n")}, tools)
            try:
                return _checked(tool, tool.name, {only: json.loads(body)}, tools)
            except ValueError:
                return BadCall(f"<{tool.tag}> takes a {schema.get('type')}, not {body[:40]!r}", tool.name)
        if not properties:
            return _checked(tool, tool.name, {}, tools)
        try:
            arguments = json.loads(body)
        except ValueError:
            return BadCall(f"<{tool.tag}> takes a JSON object of its arguments", tool.name)
        return _checked(tool, tool.name, arguments, tools)

    def result_message(self, call: Call, text: str) -> Message:
        return {"role": "tool", "content": text}


FORMATS = {"hermes": HermesFormat, "tags": TagsFormat}


def get_format(format: Union[str, HermesFormat, TagsFormat]):
    if not isinstance(format, str):
        return format
    if format not in FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[format]()
