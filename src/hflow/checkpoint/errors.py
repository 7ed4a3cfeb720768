"""What a failed save or load says: the checkpoint's step and directory, and for a full disk how
much room there is (a short write comes back from torch as `unexpected pos 704 vs 598`, which
names neither)."""
from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

from hflow.validation import UserError

_STEP = re.compile(r"^step_(\d+)(\.tmp)?$")
# PyTorchStreamWriter compares where it is with what it asked to write; a write that came up short
# (the file system ran out of room mid-record) is the only way the two part on a plain file.
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")
_FULL_TEXT = re.compile(r"no space left on device|disk quota exceeded", re.IGNORECASE)
_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointError(UserError):
    """A checkpoint cannot be written or read; the message names the step, the directory or file,
    and what to do."""


def step_of(path) -> int | None:
    """The step of `path` or of the nearest `step_N` / `step_N.tmp` directory above it."""
    for part in (Path(path), *Path(path).parents):
        match = _STEP.match(part.name)
        if match:
            return int(match.group(1))
    return None


def where(path) -> str:
    """'step 4 (/out/checkpoints/step_4)': how messages name a checkpoint."""
    step = step_of(path)
    return f"{path}" if step is None else f"step {step} ({path})"


def _causes(exc: BaseException):
    """`exc`, what it was raised from or during, and the per-rank failures DCP gathered into a
    CheckpointException (a BaseException, so `except Exception` would miss it)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` comes from a full disk or quota: ENOSPC/EDQUOT anywhere in its chain, torch's
    short-write check, or either in the text of a worker's traceback (a RemoteError carries only
    that)."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        text = str(e)
        if _SHORT_WRITE.search(text) or _FULL_TEXT.search(text):
            return True
    return False


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_space(path) -> int | None:
    for part in (Path(path), *Path(path).parents):
        try:
            return shutil.disk_usage(part).free
        except OSError:
            continue
    return None


def tree_size(path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


GENERIC_HINT = "Free some space or write checkpoints to a larger disk, then resume from the last complete one."


def disk_full_error(path, previous=None, removed: bool = False, hint: str = GENERIC_HINT) -> CheckpointError:
    """The one message for a save that ran out of room. `previous`: the last complete checkpoint
    (its size is about what the next one needs); `removed`: the partial directory is gone."""
    step = step_of(path)
    free = free_space(path)
    what = f"checkpoint step {step}" if step is not None else "the checkpoint"
    lines = [f"no space left on device: {what} could not be written to {path}"
             + (" (the partial save was removed)" if removed else "") + "."]
    room = f"{size_text(free)} free there now" if free is not None else "free space unknown"
    if previous is not None:
        room += f"; {Path(previous).name}, the last complete checkpoint, takes {size_text(tree_size(previous))}"
    lines.append(room + ".")
    lines.append(hint)
    return CheckpointError("\n".join(lines))
