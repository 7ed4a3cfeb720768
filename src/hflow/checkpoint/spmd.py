"""Checkpoints when every rank of one group runs the same code: `save_checkpoint` and
`load_checkpoint`, each called by every rank."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from .dirs import begin_save, checkpoint_dir, commit, latest_checkpoint, temporary_dir
from .errors import CheckpointError, disk_full_error, is_disk_full, where
from .extra import EXTRA_FILE, read_extra, write_extra
from .integrity import verify, warn_unverified, write_manifest
from .sharded import load_sharded, save_sharded

STATE_DIR = "state"


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def _all_gather(value, group) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def save_checkpoint(root, step: int, state: dict, extra: dict | None = None,
                    keep_last: int | None = None, process_group=None) -> Path:
    """Every rank of the group calls this: sharded `state` plus rank 0's `extra`, committed
    atomically as `<root>/step_<step>` with a manifest of every file. Returns the final
    directory. A failed save leaves no `step_<step>.tmp` behind."""
    first = _rank(process_group) == 0
    if first:
        begin_save(root, step)
    _barrier(process_group)                    # the directory is clean before anyone writes
    tmp = temporary_dir(root, step)
    try:
        written = save_sharded(tmp / STATE_DIR, state, process_group)
    except BaseException as e:                 # DCP's save is collective: every rank is here
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(tmp, latest_checkpoint(root), removed=True) from e
        raise
    reported = {f"{STATE_DIR}/{name}": entry for part in _all_gather(written, process_group) for name, entry in part.items()}
    failure = None
    if first:
        try:
            reported[EXTRA_FILE] = write_extra(tmp, extra or {})
            write_manifest(tmp, step, reported)
            commit(root, step, keep_last)
        except Exception as e:
            failure = e
            shutil.rmtree(tmp, ignore_errors=True)
    # every rank returns (or raises) only once the checkpoint exists (or is known not to)
    status = _all_gather(None if failure is None else f"{type(failure).__name__}: {failure}", process_group)[0]
    if failure is not None:
        if is_disk_full(failure):
            raise disk_full_error(tmp, latest_checkpoint(root), removed=True) from failure
        raise failure
    if status is not None:
        raise CheckpointError(f"checkpoint step {step} ({tmp}) failed on rank 0: {status}")
    return checkpoint_dir(root, step)


def load_checkpoint(path, state: dict, process_group=None) -> dict:
    """Every rank calls this: checks the files against the manifest (the ranks share the
    hashing), loads `state` in place from `save_checkpoint`'s directory and returns the extra
    dict. A damaged checkpoint raises CheckpointError naming its files."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} holds no checkpoint (it does not exist)")
    parts = _all_gather(verify(path, part=(_rank(process_group), _world(process_group))), process_group)
    if parts[0] is None:
        if _rank(process_group) == 0:
            warn_unverified(path)
    else:
        problems = [p for part in parts for p in part or []]
        if problems:
            raise CheckpointError(f"checkpoint {where(path)} is damaged: " + "; ".join(problems))
    load_sharded(path / STATE_DIR, state, process_group)
    return read_extra(path)
