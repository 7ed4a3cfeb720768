"""runtime.server.kill_if_local: a frozen peer is SIGKILLed only when it is certainly that process,
reachable by its pid from here. A hostname and a pid are not enough: containers on one host may
share a hostname but not a pid namespace, and a pid is reused once its process is gone."""
import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hflow.runtime.server import ProcessIdentity, kill_if_local, process_identity, this_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def sleeper(tmp_path):
    """A child process, under a name that /proc/<pid>/stat must parse ("(comm)" may hold ') ')."""
    program = tmp_path / "sle) ep x"
    shutil.copy(shutil.which("sleep"), program)
    child = subprocess.Popen([str(program), "60"])
    yield child
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def refuse_pidfd(monkeypatch):
    """As a kernel before 5.3, or a seccomp filter that refuses pidfd_open: then the pid is signalled."""
    def refuse(pid):
        raise OSError(errno.ENOSYS, "pidfd_open")
    monkeypatch.setattr(os, "pidfd_open", refuse, raising=False)


def survives(child) -> bool:
    time.sleep(0.2)
    return child.poll() is None


@pytest.mark.parametrize("pidfd", [True, False])
def test_a_peer_is_killed_when_it_is_that_process_here(sleeper, pidfd, monkeypatch):
    if not pidfd:
        refuse_pidfd(monkeypatch)
    peer = process_identity(sleeper.pid)
    assert None not in (peer.boot_id, peer.pid_namespace, peer.start_time)
    # the start time is in clock ticks after boot: after this test's own, not after now
    uptime_ticks = float(open("/proc/uptime").read().split()[0]) * os.sysconf("SC_CLK_TCK")
    assert this_process().start_time <= peer.start_time <= uptime_ticks + 1
    kill_if_local(peer, "a test sleeper")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize("other", [
    {"start_time": 1},                     # the pid now belongs to another process (reused)
    {"pid_namespace": 1},                  # another container on this host: its pid 123 is not ours
    {"boot_id": "another machine"},        # another machine that has the same hostname
    {"start_time": None},                  # identity unknown (no /proc where it registered)
    {"pid_namespace": None},
])
@pytest.mark.parametrize("pidfd", [True, False])
def test_a_process_that_may_not_be_the_peer_is_never_killed(sleeper, other, pidfd, monkeypatch):
    if not pidfd:
        refuse_pidfd(monkeypatch)
    kill_if_local(dataclasses.replace(process_identity(sleeper.pid), **other), "a test sleeper")
    assert survives(sleeper)


def test_nothing_is_killed_where_proc_is_another_pid_namespaces(sleeper, monkeypatch):
    peer = process_identity(sleeper.pid)
    monkeypatch.setattr(os, "readlink", lambda path: "1")   # a container that sees its host's /proc
    assert process_identity(sleeper.pid) == ProcessIdentity(sleeper.pid, None, None, None)
    kill_if_local(peer, "a test sleeper")
    assert survives(sleeper)


def test_a_gone_peer_none_and_this_process_itself_are_left_alone(sleeper):
    gone = process_identity(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    kill_if_local(gone, "a test sleeper")   # ProcessLookupError, quietly
    kill_if_local(None, "nobody")
    kill_if_local(this_process(), "this process")
    assert isinstance(this_process(), ProcessIdentity) and this_process().pid == os.getpid()
