"""Environments from the libraries users already have, named on the command line by a prefix:

    --agent.env textarena:GuessTheNumber-v0   a TextArena single-player game (textarena.py)
    --agent.env gym:FrozenLake-v1             a gymnasium environment with discrete or text actions (gymnasium.py)
    --agent.env verifiers:TASKSET             a verifiers taskset's episodes, an agent function over hflow's endpoint (verifiers.py)

Each wraps the library's own environment in an hflow Environment: reset(row) makes the library's
environment and resets it with a seed taken from the row (`row_seed`), step(text) passes the
model's turn as the action. The library is imported only when such a name is used; a missing one
is one line naming what to install. A prefix is checked before 'module:Class'
(hflow.agents.registry.environment_factory), so these names shadow a module called textarena or
gym. To pass the library's own options (a game's kwargs), subclass the adapter in a file of your
own and name that: `class Lake(GymnasiumEnv): def __init__(self): super().__init__("FrozenLake-v1",
is_slippery=False)`, then `--agent.env lake.py:Lake`.

The rows: these environments need no prompt of a data set, but the recipe samples its rows from
one. A row's game is its `seed` column when it has one (a data set of seeds names each game
exactly), else a stable hash of its prompt and answer: any data set works (the embedded default's
task gives a distinct game per problem, held-out problems held-out games), the same row is always
the same game, and a prompt's n samples play the same game, so GRPO compares like with like.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from typing import Callable

# prefix -> (the adapter's module, the library's import name, hflow's extra that installs it)
ADAPTERS: dict[str, tuple[str, str, str]] = {
    "textarena": ("hflow.agents.adapters.textarena", "textarena", "textarena"),
    "gym": ("hflow.agents.adapters.gymnasium", "gymnasium", "gymnasium"),
    "gymnasium": ("hflow.agents.adapters.gymnasium", "gymnasium", "gymnasium"),
    "verifiers": ("hflow.agents.adapters.verifiers", "verifiers", "verifiers"),
}


def adapter(prefix: str, name: str, spec: str) -> Callable:
    """The picklable factory of `prefix`'s adapter for the library's environment `name`; the
    library checked to be installed and to have it (ValueError / ImportError: one line)."""
    module, _, _ = ADAPTERS[prefix]
    if not name:
        raise ValueError(f"environment {spec!r}: expected '{prefix}:NAME', the name of one of its environments")
    return importlib.import_module(module).factory(name, spec)


def require(library: str, spec: str):
    """The library's module, or an ImportError saying which extra installs it."""
    try:
        return importlib.import_module(library)
    except ModuleNotFoundError as e:
        if e.name != library:
            raise
        raise missing(library, spec) from None


def missing(library: str, spec: str) -> ImportError:
    """The one line for a library that is not installed: which extra installs it."""
    extra = next((extra for _, lib, extra in ADAPTERS.values() if lib == library), library)
    return ImportError(f"environment {spec!r}: the {library} package is not installed "
                       f"(pip install 'hflow[{extra}]', or pip install {library})")


def row_seed(row: dict) -> int:
    """The game a row names: its `seed` column, else a stable hash of its prompt and answer."""
    if row.get("seed") is not None:
        return int(row["seed"])
    key = json.dumps([row.get("prompt"), row.get("answer", row.get("ground_truth"))], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") >> 1   # < 2**31


def one_line(error: BaseException, limit: int = 240) -> str:
    """An exception as one short line (a library's may span many, nltk's framed in asterisks)."""
    text = " ".join(str(error).replace("*", " ").split())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
