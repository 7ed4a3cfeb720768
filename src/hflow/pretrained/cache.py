"""Where pretrained models are kept, and how each is written so that a crash leaves nothing that
later counts as done.

The root is hflow's cache (`$HFLOW_CACHE`, else `~/.cache/hflow`, as hflow.default's); a
converted .gguf lives under `gguf/<sha256 of the file>/`, a fetched wheel's .gguf under
`packaged/<name>/`. Everything is made under a temporary name beside its final one and renamed
into place when complete: a reader sees the whole directory or file, or none of it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """`$HFLOW_CACHE`, else `~/.cache/hflow` (the embedded default's cache root too)."""
    return Path(os.environ.get("HFLOW_CACHE") or Path.home() / ".cache" / "hflow")


def sha256_of(path, chunk: int = 4 << 20) -> str:
    """The file's sha256, read in chunks (a .gguf is hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_complete(directory: Path) -> bool:
    """A model directory under its final name. Only a finished build is renamed to that name, so
    a crash leaves a temporary name behind (never looked at), not half a model under the final
    one; a directory there without config.json is a leftover and gets rebuilt."""
    return (Path(directory) / "config.json").is_file()


def build_dir_once(final: Path, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """`final`, made by `build(tmp)` into a temporary directory beside it and renamed into place;
    (final, whether this call built it). A build that raises leaves nothing behind; when two
    processes build at once the first rename wins."""
    final = Path(final)
    if is_complete(final):
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
    try:
        build(tmp)
        if final.exists() and not is_complete(final):   # a leftover that is not a model
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):   # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def write_file_once(final: Path, write: Callable[[Path], None]) -> Path:
    """`final`, written by `write(tmp)` to a temporary file beside it and renamed into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=final.name + ".tmp", dir=final.parent)
    os.close(fd)
    try:
        write(Path(name))
        os.replace(name, final)
    finally:
        if os.path.exists(name):
            os.unlink(name)
    return final
