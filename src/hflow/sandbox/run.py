"""One program against its tests in the sandbox (``run_tests``); the package docstring describes
the boundary and the trust model."""
import contextlib
import functools
import json
import logging
import marshal
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from hflow.sandbox.checker import Untrusted, check
from hflow.sandbox.probes import ascii_number, plan, read_report
from hflow.sandbox.uids import sandbox_uid
from hflow.sandbox.workdir import make_workdir, remove_tree, sweep_stale_once

logger = logging.getLogger("hflow.sandbox")

_HERE = os.path.dirname(os.path.abspath(__file__))
# The program loads isolation.py and child.py from bytecode this process compiled once
# (``_child_bytecode``) rather than compiling them at every start (a few ms each).
_CHILD = [sys.executable, "-I", "-S", "-B", "-c", """\
import marshal, os, sys, types
with open("child.bytecode", "rb") as f:
    codes = marshal.load(f)
os.remove("child.bytecode")
for name, path, code in codes:
    module = types.ModuleType(name)
    module.__file__ = path
    try:
        exec(code, module.__dict__)
    except ImportError:  # isolation without ctypes: child does without it
        continue
    sys.modules[name] = module
sys.modules["child"].main()
"""]
LAYERS = ("namespaces", "landlock", "seccomp", "audit_hook")  # what ``run_tests(without=...)`` may leave out
_MAX_RESULT_BYTES = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    """Killed after this long, start-up included; keep it under the pool's --reward.timeout (10 s)."""
    cpu_seconds: float = 3.0
    """CPU time (RLIMIT_CPU, whole seconds, rounded up): SIGXCPU, then SIGKILL a second later."""
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS): an allocation beyond it raises MemoryError."""
    file_size_bytes: int = 8 << 20
    """Largest file it may write (RLIMIT_FSIZE): a longer write fails."""
    processes: int = 16
    """Processes and threads of the sandbox uid (RLIMIT_NPROC), its supervisor and init included."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_files_written: int = 64
    """Files it may make in its working directory (directories and links count): the kernel counts
    them where the sandbox has a mount namespace (its tmpfs's inodes), else only the audit hook
    (files opened for writing)."""
    disk_bytes: int = 64 << 20
    """Bytes its working directory may hold, at most max_files_written files of file_size_bytes:
    the size of its tmpfs (memory, which the kernel frees with the program) where the sandbox has
    a mount namespace; elsewhere only those two limits bound the disk, through the audit hook."""


@dataclass
class RunResult:
    passed: list[bool]
    """Per test, whether it passed."""
    error: Optional[str]
    """Why the tests did not all run, if they did not: the solution's exception, a limit, a signal."""
    timed_out: bool
    """The wall or the CPU limit stopped the program."""
    pid: int
    """The supervisor's pid, which was also its process group and session id."""
    uid: Optional[int]
    """The sandbox uid it ran as (None: not root, it ran as the caller's user)."""
    workdir: str
    """Its temporary directory on the host (removed)."""
    untrusted: list[bool] = field(default_factory=list)
    """Per test, whether it could not be split into probes and the rest (then it failed, unrun)."""
    isolation: str = ""
    """The layers that were in place (``sandbox_isolation``)."""


_isolation: Optional[str] = None


def sandbox_isolation() -> str:
    """The layers that isolate a program on this machine, in one line (found once, by running one)."""
    global _isolation
    if _isolation is None:
        try:
            result = run_tests("pass", ["pass"])
            _isolation = result.isolation or f"unknown ({result.error})"
        except Exception as e:  # said, not raised: scoring will raise it where it belongs
            _isolation = f"unavailable ({type(e).__name__}: {e})"
    return _isolation


# ---------------------------------------------------------------- the sandbox

def run_tests(source: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits(),
              audit_hook: bool = True, without: Sequence[str] = ()) -> RunResult:
    """Run ``source`` in a sandboxed interpreter, then the probes of ``tests``, and check the tests
    here (see the module docstring). ``without`` leaves out layers (of ``LAYERS``; ``audit_hook=
    False`` is ``without=("audit_hook",)``): only to test the layers below them."""
    without = sorted(set(without) | (set() if audit_hook else {"audit_hook"}))
    if set(without) - set(LAYERS):
        raise ValueError(f"run_tests: unknown layers {sorted(set(without) - set(LAYERS))}; known: {LAYERS}")
    plans = []
    for test in tests:
        try:
            plans.append(plan(test))
        except Untrusted:
            plans.append(None)
    sweep_stale_once()
    workdir, lock = make_workdir()
    status_read, status_write = os.pipe()
    # The program's result and output come back through descriptors this process holds, of files
    # with no name (gone with the last descriptor): nothing is opened in the working directory,
    # where the program may have left a FIFO, a socket or a link to anywhere in their place.
    result, output = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        with sandbox_uid() as uid:
            job = {"source": source, "probes": [[asdict(p) for p in test.probes] if test else [] for test in plans],
                   "uid": uid, "without": without, "limits": _rlimit_values(limits), "status_fd": status_write,
                   "result_fd": result.fileno(), "lock_fd": lock}
            with open(os.open(os.path.join(workdir, "job.json"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                json.dump(job, f)
            with open(os.open(os.path.join(workdir, "child.bytecode"), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(_child_bytecode())
            if uid is not None:
                os.chown(workdir, uid, uid)
            proc = subprocess.Popen(
                _CHILD, cwd=workdir, env=_minimal_env(workdir),
                stdin=subprocess.DEVNULL, stdout=output, stderr=output, start_new_session=True,
                pass_fds=(status_write, result.fileno(), lock))
            os.close(status_write)
            status_write = None
            try:
                exited = _wait_unreaped(proc, limits.wall_seconds)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # before reaping: the group id is still its own
                proc.wait()
                _wait_group_gone(proc.pid)
        status = _read_pipe(status_read)  # every process that held it is gone: nothing more comes
        report = os.pread(result.fileno(), _MAX_RESULT_BYTES, 0).decode(errors="replace")
        output_tail = _read_tail(output.fileno(), 300).decode(errors="replace")
    finally:
        for fd in (status_read, status_write):
            if fd is not None:
                os.close(fd)
        result.close()
        output.close()
        remove_tree(workdir)  # its processes are gone (killed by group, namespace and uid)
        os.close(lock)
        _collect_descriptors_in_flight()
    return _result(status, report, plans, proc, exited, limits, output_tail, uid, workdir)


@functools.lru_cache(maxsize=1)
def _child_bytecode() -> bytes:
    modules = []
    for name in ("isolation", "child"):
        path = os.path.join(_HERE, f"{name}.py")
        with open(path) as f:
            modules.append((name, path, compile(f.read(), path, "exec", dont_inherit=True, optimize=0)))
    return marshal.dumps(modules)


def _rlimit_values(limits: SandboxLimits) -> dict:
    values = asdict(limits)
    values["cpu"] = max(1, math.ceil(values.pop("cpu_seconds")))
    values["memory"] = values.pop("memory_bytes")
    values["file_size"] = values.pop("file_size_bytes")
    values["alarm"] = math.ceil(values.pop("wall_seconds")) + 1  # the supervisor's own backstop
    # its working directory's tmpfs (where there is a mount namespace)
    values["work_bytes"] = min(values.pop("disk_bytes"), limits.max_files_written * limits.file_size_bytes)
    return values


def _minimal_env(workdir: str) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _wait_unreaped(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exited within ``timeout`` s, leaving it unreaped (a pidfd wakes us at once;
    Popen.wait would poll, and reap)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): poll and reap
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()  # not select.select: a trainer may hold descriptors past FD_SETSIZE
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(pidfd)


def _wait_group_gone(pgid: int, timeout: float = 2.0) -> None:
    """Until the killed group's last process is gone: the init of a pid namespace ends only once
    the kernel has ended the rest, and its orphaned zombie waits for the host's init to reap it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.001)
    logger.warning("code sandbox: process group %d outlives SIGKILL", pgid)


def _read_pipe(fd: int) -> str:
    os.set_blocking(fd, False)  # should a writer survive, what it wrote is all there is
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _collect_descriptors_in_flight() -> None:
    """Descriptors a program sent into a unix socket's own queue (where seccomp, which refuses
    socketpair, is missing) outlive it with all they hold, memfd files and its tmpfs too, until the
    kernel's collector runs, which the release of a unix socket starts: one, made and closed here."""
    with contextlib.suppress(OSError):
        for end in socket.socketpair(socket.AF_UNIX):
            end.close()


def _read_tail(fd: int, limit: int) -> bytes:
    return os.pread(fd, limit, max(0, os.fstat(fd).st_size - limit))


def _result(status: str, report_text: str, plans: list, proc, exited: bool, limits: SandboxLimits,
            output_tail: str, uid: Optional[int], workdir: str) -> RunResult:
    isolation, wait_status = "", None
    for line in status.splitlines():
        kind, _, detail = line.partition(" ")
        if kind == "fatal":
            raise RuntimeError(f"the code sandbox could not set up a program: {detail}")
        if kind == "ready":
            isolation = detail
        elif kind == "exit" and ascii_number(detail) is not None:
            wait_status = ascii_number(detail)
    returncode = proc.returncode if wait_status is None else os.waitstatus_to_exitcode(wait_status)
    offsets = [0]
    for test in plans:
        offsets.append(offsets[-1] + (len(test.probes) if test else 0))
    report = read_report(report_text, offsets[-1])
    passed = [test is not None and report.ran and i in report.done
              and check(test, report.values[offsets[i]:offsets[i + 1]]) for i, test in enumerate(plans)]
    cpu_killed = returncode in (-signal.SIGXCPU, -signal.SIGKILL) and exited
    timed_out = not exited or cpu_killed
    error = report.error
    if error is None and not (report.ran and len(report.done) >= len(plans)):
        if not exited:
            error = f"wall time limit ({limits.wall_seconds:g} s)"
        elif returncode < 0:
            error = f"killed by {signal.Signals(-returncode).name}" + (" (CPU time limit)" if cpu_killed else "")
        else:
            error = f"exit code {returncode}: {output_tail.strip()[-300:]}"
    return RunResult(passed, error, timed_out, proc.pid, uid, workdir, [test is None for test in plans], isolation)
