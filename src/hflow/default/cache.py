"""Where the embedded default's models are cached, and how each is built exactly once.

Every model here (the base model, its warm-up, the judges, the safety task's refusing policy)
is deterministic given its settings, so it is built once per machine and kept in the cache
(`$HFLOW_CACHE`, else `~/.cache/hflow`) under a name that carries the settings and a version.
The cache and its build-then-rename are hflow.pretrained's, which keeps converted and fetched
models there too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from hflow.pretrained import cache


def cache_root(cache_dir=None) -> Path:
    """`cache_dir`, else `$HFLOW_CACHE`, else `~/.cache/hflow`."""
    return Path(cache_dir) if cache_dir else cache.cache_root()


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, made by `build(tmp)` into a temporary directory beside it and renamed into place
    the first time it is asked for. A reader never sees half a model: the directory is complete
    or absent. When several runs build it at once the first rename wins and the others' copies
    are dropped; a build that raises leaves nothing behind."""
    return cache.build_dir_once(final, build)[0]
