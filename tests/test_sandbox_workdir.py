"""The sandbox's working directory on the host (hflow.sandbox.workdir): removed whatever a program
left in it, without following a link out of it; the stale ones of killed parents swept, and only
those."""
import fcntl
import inspect
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from hflow.sandbox.workdir import PREFIX, make_workdir, remove_tree, sweep_stale
from test_code_sandbox import AS_ROOT


def leave_everything(top: str, outside: str, depth: int = 1200) -> None:
    """What a program may leave in its directory: a tree deeper than the recursion limit, FIFOs, a
    socket, links out of it (to a directory and to a file outside), a loop, directories without
    rights."""
    os.mkfifo(os.path.join(top, "result"))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.join(top, "socket"))
    os.symlink(outside, os.path.join(top, "outside"))
    os.symlink(os.path.join(outside, "kept"), os.path.join(top, "outside-file"))
    os.symlink("loop", os.path.join(top, "loop"))
    path = top
    for _ in range(depth):
        path = os.path.join(path, "d")
        os.mkdir(path)  # the path stays under PATH_MAX: 2 * 1200 characters
    os.mkfifo(os.path.join(path, "fifo"))
    os.symlink(outside, os.path.join(path, "outside"))
    for name, mode in (("locked", 0), ("readonly", 0o500)):
        os.makedirs(os.path.join(top, name, "inner"))
        with open(os.path.join(top, name, "inner", "file"), "w") as out:
            out.write("x")
        os.chmod(os.path.join(top, name, "inner"), mode)
        os.chmod(os.path.join(top, name), mode)


@pytest.fixture
def outside():
    """A directory the removal must not touch, with a file in it."""
    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, "kept"), "w") as out:
        out.write("kept")
    yield directory
    subprocess.run(["rm", "-rf", directory])


def test_a_tree_of_everything_is_removed_and_nothing_outside_it(outside):
    top = tempfile.mkdtemp()
    leave_everything(top, outside)
    assert remove_tree(top)
    assert not os.path.lexists(top)
    assert os.listdir(outside) == ["kept"]
    assert remove_tree(top)  # gone already: nothing to do


@pytest.mark.skipif(not AS_ROOT, reason="makes the tree as another uid")
def test_a_removal_that_is_not_root_gives_itself_the_rights_the_program_took(outside):
    # Run as an unprivileged uid on a tree it owns, the working directory itself chmod 000 last:
    # root needs no rights, a trainer that is not root does.
    parent = tempfile.mkdtemp()
    os.chown(parent, 65534, 65534)
    os.chmod(outside, 0o755)
    code = "import os, socket\n" + inspect.getsource(leave_everything) + textwrap.dedent(f"""
        from hflow.sandbox.workdir import remove_tree
        top = os.path.join({parent!r}, "work")
        os.mkdir(top)
        leave_everything(top, {outside!r})
        os.chmod(top, 0)
        print(remove_tree(top), os.path.lexists(top))""")
    python = _python_any_uid_runs()
    try:
        run = subprocess.run([python, "-c", code], capture_output=True, text=True, user=65534, group=65534,
                             timeout=120, env={"PYTHONPATH": _src()})
        assert run.stdout.split() == ["True", "False"], run.stderr
        assert os.listdir(outside) == ["kept"]
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", parent])
        subprocess.run(["rm", "-rf", parent])


def _src() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _python_any_uid_runs() -> str:
    from test_sandbox_host import readable_python
    python = readable_python()
    if python is None:
        pytest.skip("no interpreter that another uid can run")
    return python


def stale_directory(pid: int, outside: str) -> str:
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-")
    leave_everything(path, outside, depth=50)
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid  # not reused this soon: pids climb to pid_max before they wrap


def test_the_sweep_removes_only_directories_whose_maker_is_gone_and_lock_free(outside):
    stale = stale_directory(dead_pid(), outside)
    alive = stale_directory(os.getpid(), outside)            # its maker runs
    locked = stale_directory(dead_pid(), outside)            # a supervisor still holds its lock
    other = tempfile.mkdtemp(prefix=f"{PREFIX}x-")            # not named for a maker
    holder = os.open(locked, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert sweep_stale(tempfile.gettempdir()) == [stale]
        assert not os.path.lexists(stale)
        assert all(os.path.isdir(path) for path in (alive, locked, other))
        assert os.listdir(outside) == ["kept"]
    finally:
        os.close(holder)
        for path in (alive, locked, other):
            assert remove_tree(path)


def test_a_working_directory_is_locked_while_in_use():
    path, lock = make_workdir()
    try:
        assert os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-")
        other = os.open(path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        remove_tree(path)
        os.close(lock)
