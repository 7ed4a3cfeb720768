"""The controller's own state in a checkpoint (data position, KL controller, RNG streams, ...):
`extra.json`, which loading cannot turn into running code (see safe_format)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import safe_format
from .errors import CheckpointError, where

EXTRA_FILE = "extra.json"


def write_extra(path, extra: dict) -> dict:
    """`extra` (plain values, tuples, tensors, numpy arrays: see safe_format.encode) as
    `<path>/extra.json`. One process. Returns its manifest entry ({"size", "sha256"}), hashed
    from the bytes as written."""
    data = safe_format.dumps(extra).encode()
    part = Path(path) / (EXTRA_FILE + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, Path(path) / EXTRA_FILE)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_extra(path) -> dict:
    """What `write_extra` wrote; CheckpointError when it is missing (an older hflow's checkpoint,
    with `extra.pt`, is no longer read) or unreadable."""
    file = Path(path) / EXTRA_FILE
    if not file.exists():
        raise CheckpointError(f"checkpoint {where(path)}: {file} is missing (an older hflow's checkpoint has "
                              f"extra.pt instead, which is no longer read: start the run over)")
    try:
        return safe_format.loads(file.read_text())
    except (ValueError, KeyError, TypeError, RuntimeError) as e:   # bad JSON or a bad tagged value
        raise CheckpointError(f"checkpoint {where(path)}: {file} is unreadable ({e})") from None
