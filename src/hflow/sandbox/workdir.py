"""The sandboxed program's working directory on the host (``run_tests``): made and locked while in
use, removed whatever the program left in it, and, once per process, the stale ones of parents
that were killed swept.

Where the sandbox has a mount namespace, the program works in a tmpfs of its own mounted over this
directory (``isolation.isolate_filesystem``), which ends with the namespace: the directory stays
empty. Elsewhere the program writes into it and may leave what ``shutil.rmtree`` cannot remove: a
tree deeper than Python's recursion limit, directories their owner cannot read or enter
(``chmod 000``: as root no matter, but a trainer that is not root runs the program as itself),
FIFOs, sockets, symbolic links to anywhere. ``remove_tree`` removes all of it without recursion,
one directory descriptor at a time, and never follows a link.

A directory is named for the process that made it (``hflow-sandbox-<pid>-<random>``) and locked
(flock) by it and by the sandbox's supervisor while the program runs. ``sweep_stale`` removes
those whose lock is free and whose maker is gone: a parent killed mid-run (the reward pool kills a
worker that overruns its timeout) left them.
"""
import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile
from typing import Optional

from hflow.sandbox.uids import SANDBOX_SLOTS, SANDBOX_UID_BASE

logger = logging.getLogger("hflow.sandbox")

PREFIX = "hflow-sandbox-"
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_swept = False


def make_workdir() -> tuple[str, int]:
    """A new directory in the temporary directory, and a descriptor of it that holds its lock (pass
    it on to whatever must keep the directory from the sweep; close it after ``remove_tree``)."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    fd = os.open(path, _DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # at once: nobody else knows it yet, and the sweep spares a live maker's
    return path, fd


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything beneath it; whether it is gone (else why not is logged)."""
    try:
        top = _open_directory(path, None)
    except FileNotFoundError:
        return True
    except OSError as e:
        logger.warning("code sandbox: cannot remove the working directory %s: %s", path, e)
        return False
    try:
        _remove_contents(top)
        os.rmdir(path)
        return True
    except OSError as e:
        logger.warning("code sandbox: cannot remove the working directory %s: %s", path, e)
        return False


def _remove_contents(top: int) -> None:
    """Empty the directory ``top`` (a descriptor this function closes): depth first, climbing back
    through "..", which must be the directory it came from (else OSError: the tree moved)."""
    fd = top
    below: list[list[str]] = [_remove_files(fd)]  # per level from the top, its subdirectories left
    names: list[str] = []                        # per level below the top, its name in its parent
    identities = [_identity(fd)]
    try:
        while True:
            if below[-1]:
                name = below[-1].pop()
                child = _open_subdirectory(name, fd)
                if child is not None:
                    os.close(fd)
                    fd = child
                    names.append(name)
                    identities.append(_identity(fd))
                    below.append(_remove_files(fd))
                continue
            below.pop()
            if not names:
                return
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            identities.pop()
            if _identity(parent) != identities[-1]:
                os.close(parent)
                raise OSError(f"{names[-1]!r} was moved during its removal")
            os.close(fd)
            fd = parent
            _as_owner(fd, lambda: os.rmdir(names[-1], dir_fd=fd))
            names.pop()
    finally:
        os.close(fd)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _remove_files(fd: int) -> list[str]:
    """Unlink whatever in the directory ``fd`` is not a directory; the names of those that are."""
    return _as_owner(fd, lambda: _unlink_all_but_directories(fd))


def _as_owner(fd: int, change):
    """``change()`` to the directory ``fd``, given its owner's rights first if the program took
    them away (chmod 500)."""
    try:
        return change()
    except PermissionError:
        os.fchmod(fd, 0o700)
        return change()


def _unlink_all_but_directories(fd: int) -> list[str]:
    directories = []
    with os.scandir(fd) as entries:
        for entry in entries:  # unlinking what was read already is safe while reading on
            if entry.is_dir(follow_symlinks=False):
                directories.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    return directories


def _open_subdirectory(name: str, fd: int) -> Optional[int]:
    """The subdirectory ``name`` of ``fd`` opened, or None once it was removed as not a directory."""
    try:
        return _open_directory(name, fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):  # ELOOP: a link, which O_NOFOLLOW refuses
            raise
    os.unlink(name, dir_fd=fd)  # no longer a directory: a program still running replaced it
    return None


def _open_directory(name: str, dir_fd: Optional[int]) -> int:
    """``name`` opened as a directory, not through a link; when its owner may not read it, given
    the right first (as root it needs none)."""
    try:
        return os.open(name, _DIRECTORY, dir_fd=dir_fd)
    except PermissionError:
        if os.geteuid() == 0:
            raise
        _give_owner_rights(name, dir_fd)
        return os.open(name, _DIRECTORY, dir_fd=dir_fd)


def _give_owner_rights(name: str, dir_fd: Optional[int]) -> None:
    """chmod 700 the directory ``name`` itself: through an O_PATH descriptor, which a link cannot
    stand in for (chmod has no flag not to follow one)."""
    handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
    finally:
        os.close(handle)


# ---------------------------------------------------------------- stale directories

def sweep_stale_once() -> None:
    """``sweep_stale`` in the temporary directory, the first time this process calls it."""
    global _swept
    if not _swept:
        _swept = True
        sweep_stale(tempfile.gettempdir())


def sweep_stale(directory: str) -> list[str]:
    """Remove the working directories in ``directory`` that are this user's (as root, also the
    sandbox uids'), whose maker is gone and whose lock nobody holds; the paths removed."""
    removed = []
    try:
        with os.scandir(directory) as entries:
            stale = [entry.path for entry in entries if _maybe_stale(entry)]
    except OSError:
        return removed
    for path in stale:
        with contextlib.suppress(OSError):
            fd = _open_directory(path, None)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use
                if remove_tree(path):
                    removed.append(path)
            finally:
                os.close(fd)
    if removed:
        logger.info("code sandbox: removed %d working directories of parents that were killed", len(removed))
    return removed


def _maybe_stale(entry: os.DirEntry) -> bool:
    maker = entry.name[len(PREFIX):].split("-", 1)[0]
    if not (entry.name.startswith(PREFIX) and maker.isascii() and maker.isdigit()):
        return False
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    ours = info.st_uid == os.geteuid() or os.geteuid() == 0 and \
        SANDBOX_UID_BASE <= info.st_uid < SANDBOX_UID_BASE + SANDBOX_SLOTS
    return stat.S_ISDIR(info.st_mode) and ours and not _alive(int(maker))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True
