"""Crash injection for the checkpoint tests: run a function in a forked child that counts every
operation that changes the disk and dies (os._exit, as a SIGKILL would: no `except` or `finally`
runs, nothing is flushed that was not) at the N-th.

The operations counted: each write() on a file opened for writing (the crash writes the first half
of that buffer and flushes it: a torn write), os.fsync, os.mkdir, os.rename, os.replace, os.unlink
(os.remove) and os.rmdir, which shutil.rmtree, pathlib, DCP's file system writer and hflow all go
through. Code that writes without Python's file objects (safetensors' Rust writer) is one step
between two counted ones.

    code, ops = run_crashing(lambda: ck.save_run(root, 3, groups, {}), crash_at=7, relative_to=root)
    # code: CRASHED when it died at its 7th operation (ops[-1], not done), 0 when it finished first

`crash_points` enumerates N = 1, 2, ... on fresh copies of a directory until the function finishes.
"""
from __future__ import annotations

import builtins
import gc
import io
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

CRASHED = 86
_FAILED = 1


class _Counter:
    def __init__(self, crash_at: int | None, log_file: str, relative_to: Path):
        self.crash_at, self.log_file, self.relative_to = crash_at, log_file, str(relative_to) + os.sep
        self.ops: list[list[str]] = []

    def point(self, kind: str, *paths, before_dying=lambda: None) -> None:
        self.ops.append([kind, *(self._name(p) for p in paths)])
        if len(self.ops) == self.crash_at:
            before_dying()
            self.save_log()
            os._exit(CRASHED)

    def _name(self, path) -> str:
        text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else f"fd {path}"
        return text.removeprefix(self.relative_to)

    def save_log(self) -> None:
        with _REAL["open"](self.log_file, "w") as f:
            json.dump(self.ops, f)


_REAL = {"open": builtins.open, **{name: getattr(os, name) for name in
                                  ("fsync", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")}}


class _CountedFile:
    """A file opened for writing whose every write() is a crash point."""

    def __init__(self, file, counter: _Counter, path):
        self._file, self._counter, self._path = file, counter, path

    def write(self, data):
        def torn():
            whole = data if isinstance(data, str) else memoryview(data).cast("B")
            self._file.write(whole[: len(whole) // 2])
            self._file.flush()
        self._counter.point("write", self._path, before_dying=torn)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


def _install(counter: _Counter) -> None:
    def counted_open(file, mode="r", *args, **kwargs):
        opened = _REAL["open"](file, mode, *args, **kwargs)
        writes = any(c in mode for c in "wax+")
        return _CountedFile(opened, counter, file) if writes else opened

    def fsync(fd):
        counter.point("fsync", _fd_path(fd))
        return _REAL["fsync"](fd)

    def one_path(name):
        def op(path, *args, **kwargs):
            counter.point(name, _at(path, kwargs.get("dir_fd")))
            return _REAL[name](path, *args, **kwargs)
        return op

    def two_paths(name):
        def op(src, dst, *args, **kwargs):
            counter.point(name, src, dst)
            return _REAL[name](src, dst, *args, **kwargs)
        return op

    builtins.open = io.open = counted_open
    os.fsync = fsync
    for name in ("mkdir", "unlink", "remove", "rmdir"):
        setattr(os, name, one_path(name))
    for name in ("rename", "replace"):
        setattr(os, name, two_paths(name))


def _fd_path(fd) -> str:
    fd = fd if isinstance(fd, int) else fd.fileno()
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def _at(path, dir_fd) -> str:
    # shutil.rmtree removes entries relative to an open directory
    return os.path.join(_fd_path(dir_fd), os.fsdecode(path)) if dir_fd is not None else os.fsdecode(path)


def run_crashing(fn, crash_at: int | None, relative_to, timeout: float = 60.0) -> tuple[int, list[list[str]]]:
    """Run `fn()` in a forked child that dies at its `crash_at`-th disk operation (None: never).
    Returns the child's exit status (CRASHED, or 0 when `fn` returned first) and the operations it
    reached, paths relative to `relative_to`; the last one is where it died, not done."""
    fd, log_file = tempfile.mkstemp(prefix="crash_ops_", suffix=".json")
    os.close(fd)
    ended_r, ended_w = os.pipe()      # closed by the child's exit: waited on without polling
    try:
        pid = os.fork()
        if pid == 0:
            os.close(ended_r)
            _child(fn, _Counter(crash_at, log_file, Path(relative_to)))
        os.close(ended_w)
        code = _wait(pid, ended_r, timeout)
        with open(log_file) as f:
            ops = json.loads(f.read() or "[]")
    finally:
        os.close(ended_r)
        os.unlink(log_file)
    if code not in (0, CRASHED):
        raise AssertionError(f"the child failed (exit status {code}) after {len(ops)} operations: {ops[-3:]}")
    return code, ops


def _child(fn, counter: _Counter):
    code = _FAILED
    try:
        if torch.get_num_threads() > 1:    # a forked child must not wait for the parent's OpenMP
            torch.set_num_threads(1)        # threads (they are not copied)
        _install(counter)
        fn()
        code = 0
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        counter.save_log()
        os._exit(code)


def _wait(pid: int, ended, timeout: float) -> int:
    ready, _, _ = select.select([ended], [], [], timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the child {pid} did not finish in {timeout} s")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def scratch_dir():
    """A temporary directory, in memory where the machine has /dev/shm: the crashes here kill a
    process, which leaves the page cache (and so the file system) as it was, and each fsync on a
    disk would cost milliseconds a point."""
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix="crash_sweep_", dir=shm if os.access(shm, os.W_OK) else None)


_FROZEN = [0]


@contextmanager
def _heap_frozen():
    # a collection in a child would touch every object of the parent's heap, copying its pages
    # (~200 ms a child); frozen objects are not collected. Sweeps nest (a resume's inside a save's).
    if _FROZEN[0] == 0:
        gc.collect()
        gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0:
            gc.unfreeze()


def crash_points(prepare, fn, check, limit: int = 10_000) -> int:
    """Every crash point of `fn(root)`: for N = 1, 2, ... a fresh `root` from `prepare(root)`,
    `fn(root)` killed at its N-th disk operation, then `check(root, ops)` (ops: what it did, the
    last one not done); until `fn` finishes without reaching N. Returns how many points there
    were."""
    with _heap_frozen(), scratch_dir() as scratch:
        template = Path(scratch) / "template"
        template.mkdir()
        prepare(template)
        for n in range(1, limit + 1):
            root = Path(scratch) / f"crash_{n}"
            shutil.copytree(template, root)
            code, ops = run_crashing(lambda: fn(root), n, relative_to=root)
            if code == 0:
                assert len(ops) == n - 1, f"{len(ops)} operations, expected {n - 1}: not deterministic"
                return n - 1
            check(root, ops)
            shutil.rmtree(root)
    raise AssertionError(f"still crashing after {limit} points")
