"""Code reward (``--reward.fn code``): run a generated Python solution against tests, in a sandbox.

Layout. The ground truth (the ``--data.answer-key`` column) holds the tests: a list of Python
statements (MBPP's ``test_list``: ``--data.answer-key test_list``) or one string with one
statement per line (the built-in ``--data.task code``), typically ``assert f(2) == 4``. The
response is the solution: its last ```` ```python ```` block (or ```` ```py ````, or an unlabelled
fence; an unclosed one runs to the end), or the whole text when it has no fence.

Score. The solution runs, then each test in its namespace; score = the fraction of the tests that
run without raising, 0 when the solution itself raises, exits or hits a limit before the tests.
Partial credit gives a denser signal than all-or-nothing; the ``all_passed`` metric is the strict
rate. Metrics: ``all_passed``, ``timed_out`` (wall or CPU limit).

The sandbox (``run_tests``) runs each program as a fresh ``python -I -S -B`` (isolated mode: no
PYTHON* variables, no site-packages, no bytecode written: the standard library only), with:

- limits (``SandboxLimits``): CPU time, address space, file size, open files and processes
  (rlimits, set by the child before the solution runs), and wall time (the parent kills it);
- a fresh temporary directory as its working directory, HOME and TMPDIR, removed afterwards;
- an environment of PATH, LANG, HOME and TMPDIR only: none of the trainer's variables (tokens, keys);
- its own session and process group, killed as a whole (SIGKILL) at the wall limit or once it
  returns; should the parent die first (the pool kills a worker past --reward.timeout), its own
  alarm (SIGALRM, a second after the wall limit) ends it;
- when run as root, a uid of its own. RLIMIT_NPROC counts the processes of a real uid and is not
  enforced for root, so the child drops (setgroups, setgid, setuid) to one of 64 unprivileged uids
  from 1879048192 (a range systemd's UID notes leave unused), one per program running at the
  time, claimed with a file lock. The uid makes the process limit hold, keeps the program out of
  root-owned files and lets the parent kill, after the run, every process of that uid, also one
  that left the process group with setsid. The drop happens in the child after start-up; when the
  uid cannot read the standard library (an interpreter under /root), the child first imports
  ``_code_child.PRELOAD`` (the modules solutions commonly use), and the solution can import
  nothing else. Without root the program runs as the trainer's user with RLIMIT_NPROC 0 (the
  limit counts all that user's processes, so no other value bounds the program's): it can start
  no process or thread;
- an audit hook (PEP 578), installed before the solution runs, that refuses process creation
  (fork, exec, spawn, subprocess, os.system), signals, sockets, ctypes, symlinks, writes outside
  the temporary directory (and more than ``max_files_written`` files) and reads outside it and the
  standard library (so no /proc/<pid>/environ, ~/.netrc or dataset files).

This is not a security boundary against a determined attacker. The audit hook runs in the
interpreter it guards: a program can reach it, the functions it calls and the result channel
through frames or the garbage collector; the tests run in the solution's process, so an object
whose ``__eq__`` is always true passes ``assert f(1) == 2``; nothing bounds the disk besides the
file limits; and the kernel is shared. A boundary is a container or VM with seccomp, no network
and a read-only root (gVisor, Firecracker, nsjail). What these layers contain are the usual
accidents and naive hostile programs of RL rollouts (infinite loops, fork bombs, memory hogs,
stray writes, reading secrets, crashes): each scores 0 within its limit and leaves nothing
behind (tests/test_code_reward.py). Linux only (/proc, RLIMIT_NPROC as Linux counts it).
"""
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

logger = logging.getLogger("hflow.rewards")

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_child.py")
SANDBOX_UID_BASE = 1_879_048_192
SANDBOX_SLOTS = 64  # programs sandboxed at once on a machine, one uid each
_MAX_RESULT_BYTES = 1 << 20
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


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
    """Processes and threads of the sandbox uid (RLIMIT_NPROC), the program itself included."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_files_written: int = 64
    """Files it may open for writing (the audit hook counts): with file_size_bytes, bounds the disk."""


@dataclass
class RunResult:
    passed: list[bool]
    """Per test, whether it ran without raising."""
    error: Optional[str]
    """Why the tests did not all run, if they did not: the solution's exception, a limit, a signal."""
    timed_out: bool
    """The wall or the CPU limit stopped the program."""
    pid: int
    """The program's pid, which was also its process group and session id."""
    uid: Optional[int]
    """The sandbox uid it ran as (None: not root, it ran as the caller's user)."""
    workdir: str
    """Its temporary directory (removed)."""


def extract_code(response: str) -> str:
    """The last fenced code block of ``response`` (python, py or unlabelled), else the whole text."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth) -> list[str]:
    """The tests of a row: a list of statements, or a string with one statement per line."""
    if isinstance(ground_truth, str):
        tests = [line for line in ground_truth.splitlines() if line.strip()]
    elif isinstance(ground_truth, (list, tuple)) and all(isinstance(t, str) for t in ground_truth):
        tests = [t for t in ground_truth if t.strip()]
    else:
        raise ValueError(f"code reward: the ground truth must hold the tests, a list of statements or "
                         f"a string with one per line (--data.answer-key); got {type(ground_truth).__name__}")
    if not tests:
        raise ValueError("code reward: a row has no tests (its --data.answer-key value is empty)")
    return tests


def code_score(response: str, ground_truth, **extra) -> dict:
    """Fraction of the tests (``ground_truth``) that pass after the response's code ran."""
    tests = parse_tests(ground_truth)
    result = run_tests(extract_code(response), tests)
    passed = sum(result.passed)
    return {"score": passed / len(tests), "all_passed": float(passed == len(tests)),
            "timed_out": float(result.timed_out)}


# ---------------------------------------------------------------- the sandbox

def run_tests(source: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits(),
              audit_hook: bool = True) -> RunResult:
    """Run ``source`` then each of ``tests`` in a sandboxed interpreter (see the module docstring).
    ``audit_hook=False`` leaves out the hook: only to test the layers below it."""
    token = secrets.token_hex(16)  # result lines carry it: a solution cannot forge them by printing
    workdir = tempfile.mkdtemp(prefix="hflow-sandbox-")
    try:
        with _sandbox_uid() as uid:
            job = {"token": token, "source": source, "tests": list(tests), "uid": uid,
                   "audit_hook": audit_hook, "limits": _rlimit_values(limits, uid)}
            with open(os.open(os.path.join(workdir, "job.json"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                json.dump(job, f)
            if uid is not None:
                os.chown(workdir, uid, uid)
            with open(os.path.join(workdir, "output"), "wb") as output:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", CHILD_SCRIPT], cwd=workdir, env=_minimal_env(workdir),
                    stdin=subprocess.DEVNULL, stdout=output, stderr=output, start_new_session=True)
            try:
                exited = _wait_unreaped(proc, limits.wall_seconds)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # before reaping: the group id is still its own
                proc.wait()
            lines = _read_tail(os.path.join(workdir, "result"), _MAX_RESULT_BYTES).decode(errors="replace")
            output_tail = _read_tail(os.path.join(workdir, "output"), 300).decode(errors="replace")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(token, lines, len(tests), proc, exited, limits, output_tail, uid, workdir)


def _rlimit_values(limits: SandboxLimits, uid: Optional[int]) -> dict:
    values = asdict(limits)
    if uid is None:  # the count is the caller's user's: only 0 is a bound that holds (no fork, no thread)
        values["processes"] = 0
    values["cpu"] = max(1, math.ceil(values.pop("cpu_seconds")))
    values["memory"] = values.pop("memory_bytes")
    values["file_size"] = values.pop("file_size_bytes")
    values["alarm"] = math.ceil(values.pop("wall_seconds")) + 1  # the child's own backstop
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


def _read_tail(path: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read(limit)
    except OSError:
        return b""


def _result(token: str, lines: str, num_tests: int, proc, exited: bool, limits: SandboxLimits,
            output_tail: str, uid: Optional[int], workdir: str) -> RunResult:
    passed, error = [False] * num_tests, None
    for line in lines.splitlines():
        marker, _, rest = line.partition(" ")
        if marker != token:
            continue
        kind, _, detail = rest.partition(" ")
        if kind == "test":
            index, _, ok = detail.partition(" ")
            if index.isdigit() and int(index) < num_tests:
                passed[int(index)] = ok == "1"
        elif kind == "error":
            error = detail
        elif kind == "fatal":
            raise RuntimeError(f"the code sandbox could not set up a program: {detail}")
    cpu_killed = proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and exited
    timed_out = not exited or cpu_killed
    reported = lines.count(f"{token} test ")
    if error is None and reported < num_tests:
        if not exited:
            error = f"wall time limit ({limits.wall_seconds:g} s)"
        elif proc.returncode < 0:
            error = f"killed by {signal.Signals(-proc.returncode).name}" + (" (CPU time limit)" if cpu_killed else "")
        else:
            error = f"exit code {proc.returncode}: {output_tail.strip()[-300:]}"
    return RunResult(passed, error, timed_out, proc.pid, uid, workdir)


# ---------------------------------------------------------------- a uid per program (as root)

@contextlib.contextmanager
def _sandbox_uid():
    """None without root; as root, a uid of the sandbox range that no other program uses
    meanwhile (a file lock per uid), whose processes are all killed when the program is done."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = "/tmp/hflow-code-sandbox-uids"  # not $TMPDIR: every process on the machine must share the locks
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    info = os.lstat(lock_dir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"code sandbox: {lock_dir} must be a directory that only root can write; remove it")
    first = os.getpid() % SANDBOX_SLOTS  # concurrent workers start on different slots
    for slot in [(first + k) % SANDBOX_SLOTS for k in range(SANDBOX_SLOTS)]:
        fd = os.open(os.path.join(lock_dir, str(slot)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uid = SANDBOX_UID_BASE + slot
        try:
            if os.pread(fd, 5, 0) != b"clean":  # the last holder died mid-run: its processes may live
                _kill_processes_of(uid)
            os.pwrite(fd, b"dirty", 0)
            try:
                yield uid
            finally:
                _kill_processes_of(uid)
            os.pwrite(fd, b"clean", 0)
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError(f"code sandbox: more than {SANDBOX_SLOTS} programs at once on this machine")


def processes_of(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose real uid is ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:  # it exited meanwhile
            continue
        uid_at, state_at = status.find(b"\nUid:") + 5, status.find(b"\nState:") + 7
        if int(status[uid_at:uid_at + 16].split()[0]) == uid and status[state_at:state_at + 3].strip()[:1] != b"Z":
            pids.append(int(name))
    return pids


def _kill_processes_of(uid: int) -> None:
    """SIGKILL every process of ``uid``, again until none is left (one may fork meanwhile)."""
    for _ in range(100):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    logger.warning("code sandbox: processes of uid %d survive SIGKILL: %s", uid, processes_of(uid))
