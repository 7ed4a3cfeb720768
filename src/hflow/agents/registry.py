"""Environments by name: what `--agent.env` can say (a built-in, 'module:Class' or
'path/file.py:Class') and the picklable factory each names, for the actor ranks to build from."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Union

from hflow.agents.environment import Environment, load_environment
from hflow.agents.multi_question import MultiQuestion
from hflow.agents.tool_environment import ToolEnvironment

EnvSpec = Union[str, Callable[[], Environment]]

# picklable factories by name: what `--agent.env calculator` style flags can say. Each takes
# reward_fn=, the rule that scores the final answer (a turn with no call); none: reward 0.
BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "calculator": functools.partial(ToolEnvironment, ("calculator",), format="tags"),
    "calculator_hermes": functools.partial(ToolEnvironment, ("calculator",), format="hermes"),
    # the same task with the tool switched off: a call goes unanswered, the turn is the final answer
    "no_tools": functools.partial(ToolEnvironment, (), format="tags"),
    # three problems in a row ("27+82=" and two like it), one a turn, each answer rewarded on its own
    "multi_question": functools.partial(MultiQuestion, questions=3),
}


def environment_factory(spec: EnvSpec) -> Callable[[], Environment]:
    """A built-in name, a library's environment ('textarena:GAME', 'gym:ENV': adapter_factory),
    'module:Class' / 'path/file.py:Class', or a class / picklable factory."""
    if isinstance(spec, str):
        if spec in BUILTIN_ENVIRONMENTS:
            return BUILTIN_ENVIRONMENTS[spec]
        return adapter_factory(spec) or load_environment(spec)
    if callable(spec):
        return spec
    raise TypeError(f"an environment spec is a name ({', '.join(BUILTIN_ENVIRONMENTS)}), 'module:Class' or a "
                    f"class, not {type(spec).__name__}")


def adapter_factory(spec: str) -> Optional[Callable[[], Environment]]:
    """The picklable factory of an environment library's adapter (hflow.agents.adapters) when
    `spec` starts with its prefix ('textarena:GuessTheNumber-v0'), checked before 'module:Class';
    None for any other spec. A ValueError / ImportError (one line) when the library lacks it or
    is not installed."""
    from hflow.agents.adapters import ADAPTERS, adapter
    prefix, colon, name = spec.partition(":")
    return adapter(prefix, name, spec) if colon and prefix in ADAPTERS else None
