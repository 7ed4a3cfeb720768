"""Sharded state with torch.distributed.checkpoint (DCP): every rank writes its own shards, and
loading reshards. Collective over a process group.

On top of DCP's file system reader and writer:
- each rank hashes the files it wrote, right after writing them (returned for the manifest);
- `.metadata` is unpickled through an allowlist of DCP's metadata types, and the small non-tensor
  entries (schedules, optimizer hyper-parameters, RNG strings) with `weights_only=True`, so that a
  crafted checkpoint raises instead of running code;
- before loading, every shard file must be there and as long as `.metadata` says, so a truncated
  shard is named (file and step) instead of surfacing as a zip-reader error;
- a full disk is reported as such (torch says `unexpected pos 704 vs 598`).
"""
from __future__ import annotations

import io
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from .errors import CheckpointError, disk_full_error, is_disk_full, where
from .integrity import check_dcp_extents, hash_file
from .safe_format import dcp_metadata_globals, read_dcp_metadata, restricted_load, weights_only_reason


class _HashingWriter(FileSystemWriter):
    def __init__(self, path):
        super().__init__(path)
        self.written: dict[str, dict] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        for name in sorted({result.storage_data.relative_path for result in future.value()}):
            self.written[name] = hash_file(Path(self.path) / name)
        return future

    def finish(self, metadata, results):
        super().finish(metadata, results)          # the coordinator only
        self.written[".metadata"] = hash_file(Path(self.path) / ".metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        file = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(file, "rb") as f:
            metadata = restricted_load(f, dcp_metadata_globals(), str(file))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value):
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"checkpoint {where(self.path)}: refused to load the entry "
                                  f"{read_item.dest_index.fqn!r}: it holds more than plain values and tensors "
                                  f"({weights_only_reason(e)}); the checkpoint was tampered with or not written by hflow, and "
                                  f"nothing in it was run") from None
        # DefaultLoadPlanner unpickles with weights_only=False; what it gets here is our own
        # pickle of an object that passed the weights_only check
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def _ours(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError a rank raised inside a DCP collective (DCP re-raises every rank's
    failures as one CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                return inner
    return None


def save_sharded(path, state: dict, process_group=None) -> dict[str, dict]:
    """Save `state` (Stateful objects and/or tensors) with DCP. Collective over `process_group`
    (the default group when None, or a single process when torch.distributed is not set up).
    Returns the files this rank wrote, relative to `path`, with their size and sha256."""
    writer = _HashingWriter(Path(path))
    try:
        with _single_process_is_fine():
            dcp.save(state, storage_writer=writer, process_group=process_group,
                     no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        if is_disk_full(e):
            raise disk_full_error(path) from e
        raise _ours(e) or e
    return writer.written


def load_sharded(path, state: dict, process_group=None):
    """Load into `state` in place (Stateful objects get `load_state_dict`). Collective."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no .metadata file)")
    problems = check_dcp_extents(path, read_dcp_metadata(path))
    if problems:
        raise CheckpointError(f"checkpoint {where(path)} is damaged: " + "; ".join(problems))
    try:
        with _single_process_is_fine():
            dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(path),
                     process_group=process_group, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise _ours(e) or e


@contextmanager
def _single_process_is_fine():
    # DCP warns that it "assumes" a single process even when no_dist=True says so.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
