"""Tools: plain Python functions with type hints and a docstring, described by a JSON schema.

    def lookup(city: str) -> str:
        '''The weather in a city.

        Args:
            city: The city's name.
        '''

    as_tool(lookup)                 # its schema (transformers' get_json_schema) goes to the chat template
    as_tool("calculator")           # a built-in: calculator, python
    as_tool("my_tools:lookup")      # a function by module path

A tool returns text (numbers, None, lists and dicts of JSON values are turned into text; anything
else is garbage and ends the trajectory as a tool error). When the *input* is the model's
mistake it raises ToolInputError: the message goes back to the model as the result and the
trajectory goes on; any other exception ends the trajectory (reward 0, counted).

Tools run in worker processes by reference, so a tool must be importable: defined at module level
of an importable module (an environment's file loaded by path is made importable).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from hflow.rewards import get_reward_fn

MAX_RESULT_CHARS = 100_000   # far past any token budget; keeps a runaway tool from flooding the pipe

BUILTIN_TOOLS = {
    "calculator": "hflow.agents.builtin_tools:calculator",
    "python": "hflow.agents.builtin_tools:python",
}


class ToolInputError(Exception):
    """Raised by a tool whose input is the model's mistake; its message becomes the tool's result."""


@dataclass(frozen=True)
class Tool:
    fn: Callable
    name: str
    schema: dict = field(repr=False)
    """{"type": "function", "function": {"name", "description", "parameters"}}: what tools= takes."""
    tag: str
    """The tags format's call, <tag>arguments</tag>."""
    inline: bool = False
    """Runs in the calling process: only for tools that are fast and cannot hang."""

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def tool(name: Optional[str] = None, tag: Optional[str] = None, inline: bool = False) -> Callable:
    """Decorator giving a function's defaults for as_tool; it returns the function itself, so
    that the function still pickles by reference into the tool workers."""
    def mark(fn):
        fn.hflow_tool = {"name": name, "tag": tag, "inline": inline}
        return fn
    return mark


def as_tool(spec: Union[Tool, Callable, str], name: Optional[str] = None, tag: Optional[str] = None,
            inline: Optional[bool] = None) -> Tool:
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, str):
        fn = _import_tool(spec)
    elif callable(spec):
        fn = spec
    else:
        raise TypeError(f"a tool is a function, a Tool or a name, not {type(spec).__name__}")
    marked = getattr(fn, "hflow_tool", {})
    name = name or marked.get("name") or fn.__name__
    schema = tool_schema(fn, name)
    return Tool(fn, name, schema, tag or marked.get("tag") or name,
                marked.get("inline", False) if inline is None else inline)


def _import_tool(spec: str) -> Callable:
    try:
        return get_reward_fn(BUILTIN_TOOLS.get(spec, spec))   # the same module:function loader
    except ValueError as e:
        if spec not in BUILTIN_TOOLS and ":" not in spec:
            raise ValueError(f"unknown tool {spec!r}: use one of {', '.join(sorted(BUILTIN_TOOLS))}, "
                             "or 'package.module:function'") from None
        raise ValueError(str(e).replace("reward function", "tool")) from None


def tool_schema(fn: Callable, name: Optional[str] = None) -> dict:
    """The function's JSON schema from its type hints and its docstring's Args: section."""
    from transformers.utils import get_json_schema   # transformers is slow to import: only when used

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # its own DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema from its signature and docstring "
                         f"({e}); give every argument a type hint and a line under 'Args:'") from e
    if name:
        schema["function"]["name"] = name
    return schema


# ---------------------------------------------------------------- arguments and results

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _fits(value: Any, schema: dict) -> bool:
    if value is None and schema.get("nullable"):
        return True
    kinds = schema.get("type")
    if kinds is None:
        return True
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        types = _JSON_TYPES.get(kind)
        if types is None:
            return True   # a schema type we do not check
        if isinstance(value, types) and not (isinstance(value, bool) and kind in ("integer", "number")):
            return True
    return False


def argument_problem(tool: Tool, arguments: Any) -> Optional[str]:
    """What is wrong with a call's arguments, said to the model; None when they fit the schema."""
    if not isinstance(arguments, dict):
        return f"the arguments of {tool.name} must be a JSON object, not {type(arguments).__name__}"
    properties = tool.parameters.get("properties", {})
    missing = [p for p in tool.parameters.get("required", []) if p not in arguments]
    unknown = [a for a in arguments if a not in properties]
    wrong = [a for a, v in arguments.items() if a in properties and not _fits(v, properties[a])]
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
               ([f"unknown {', '.join(unknown)}"] if unknown else []) + \
               [f"{a} must be of type {properties[a].get('type')}" for a in wrong]
    return f"bad arguments for {tool.name}: {'; '.join(problems)}" if problems else None


def result_text(out: Any) -> Optional[str]:
    """A tool's return value as text; None for garbage."""
    if isinstance(out, str):
        text = out
    elif out is None:
        text = ""
    elif isinstance(out, (bool, int)) or (isinstance(out, float) and math.isfinite(out)):
        text = str(out)
    elif isinstance(out, (list, dict)):
        try:
            text = json.dumps(out, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return None
    else:
        return None
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " [truncated]"


def invoke(fn: Callable, arguments: dict) -> tuple[str, str]:
    """Call a tool: ("ok", text), ("bad_input", the tool's message to the model) or ("error", why)."""
    try:
        out = fn(**arguments)
    except ToolInputError as e:
        return "bad_input", str(e) or type(e).__name__
    except Exception as e:  # any fault of the tool's own ends its trajectory, not the run
        return "error", f"{type(e).__name__}: {e}"[:500]
    text = result_text(out)
    if text is None:
        return "error", f"returned garbage: {type(out).__name__} {repr(out)[:60]}"
    return "ok", text
