"""Where the embedded default's models are cached, and how each is built exactly once.

Every model here (the base model, its warm-up, the judges, the safety task's refusing policy)
is deterministic given its settings, so it is built once per machine and kept in the cache
(`$HFLOW_CACHE`, else `~/.cache/hflow`) under a name that carries the settings and a version.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root(cache_dir=None) -> Path:
    """`cache_dir`, else `$HFLOW_CACHE`, else `~/.cache/hflow`."""
    return Path(cache_dir or os.environ.get("HFLOW_CACHE") or Path.home() / ".cache" / "hflow")


def is_built(path: Path) -> bool:
    return (Path(path) / "config.json").exists()


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, made by `build(tmp)` into a temporary directory beside it and renamed into place
    the first time it is asked for. A reader never sees half a model: the directory is complete
    or absent. When several runs build it at once the first rename wins and the others' copies
    are dropped; a build that raises leaves nothing behind."""
    final = Path(final)
    if is_built(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
    try:
        build(tmp)
        if final.exists() and not is_built(final):   # a leftover that is not a model
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_built(final):   # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
