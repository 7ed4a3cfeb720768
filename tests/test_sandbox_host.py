"""The host after every hostile program (tests/attacks): the code sandbox leaves nothing behind.

Each attack leaves on the machine what it can, or holds memory the limits do not count: FIFOs,
symbolic links and sockets where the parent read the program's files, directories their owner
cannot enter, a tree deeper than Python's recursion limit, as many files and bytes as the disk
takes, System V shared memory, message queues and semaphores, memfd files, descriptors passed into
a socket's own queue, a result that costs the parent most to read. Each runs under a parent of its
own (a fresh interpreter, whose time and memory are measured), with every layer and with one left
out, and afterwards the host must be as it was: no ``hflow-sandbox-<parent's pid>-*`` in the
temporary directory, no System V IPC object more, shared memory (``Shmem`` in /proc/meminfo) back
to where it was, no process of the sandbox's uid, the parent's time and peak memory within bounds.
A wrong solution scores 0 unless the attack worked (tests/attacks/README.md)."""
import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

import pytest

from hflow.sandbox import SANDBOX_SLOTS, SANDBOX_UID_BASE, SandboxLimits
from hflow.sandbox.child import others_can_read
from hflow.sandbox.uids import processes_of
from hflow.sandbox.workdir import sweep_stale
from test_code_sandbox import AS_ROOT, ATTACKS, FORGERIES, HOOK_ATTACKS, SLACK, attack

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=192 << 20, processes=8,
                       max_files_written=16, file_size_bytes=1 << 20)
SHMEM_SLACK_KIB = 32 << 10       # other jobs share this machine; the attacks hold 256 MiB and more
PARENT_MAX_RSS_KIB = 160 << 10   # the parent's peak: an interpreter, the sandbox, a 1 MiB report read
PARENT = """
import json, os, sys, time
sys.path.insert(0, {src!r})
from hflow.sandbox import SandboxLimits, run_tests
limits, tests, without = (json.loads(arg) for arg in sys.argv[1:4])
source = sys.stdin.read()
start = time.monotonic()
try:
    result = run_tests(source, tests, SandboxLimits(**limits), without=without)
    out = {{"passed": result.passed, "error": result.error, "workdir": result.workdir, "pid": result.pid,
           "uid": result.uid, "isolation": result.isolation}}
except Exception as e:
    out = {{"raised": f"{{type(e).__name__}}: {{e}}"[:300], "uid": None}}
with open("/proc/self/status") as f:  # not ru_maxrss, which counts the forking process's memory
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
out.update(seconds=time.monotonic() - start, max_rss_kib=peak, parent_pid=os.getpid())
print(json.dumps(out))
"""

pytestmark = pytest.mark.timeout(300)


@functools.lru_cache(maxsize=1)
def readable_python() -> Optional[str]:
    """An interpreter whose standard library any uid may read, so that an attack can import
    ctypes and socket in the sandbox (as root the program runs as a sandbox uid, which cannot read
    an interpreter under /root) and a parent that is not root can run: this one, or the
    system's."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run([candidate, "-c", "import os, sys; print(sys.version_info >= (3, 10), "
                                    "os.path.dirname(os.__file__))"], capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        recent, _, stdlib = probe.stdout.strip().partition(" ")
        if probe.returncode == 0 and recent == "True" and others_can_read(stdlib) \
                and others_can_read(os.path.realpath(candidate).rsplit("/", 1)[0]):
            return candidate
    return None


# ---------------------------------------------------------------- the host's state

# Other jobs share this machine, and may run sandboxes too: what is looked at is this run's (its
# parent's directories, its uid's processes, IPC objects that a sandbox uid or ``NOT_ROOT`` made);
# only shared memory is the whole machine's.
NOT_ROOT = 65534


@dataclass
class Host:
    ipc: frozenset          # (kind, id) of the System V IPC objects a sandbox could have made
    shmem_kib: int


def host_now() -> Host:
    ipc = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = [line.split() for line in f]
        for row in rows:
            creator = int(row[header.index("cuid")])
            if creator == NOT_ROOT or SANDBOX_UID_BASE <= creator < SANDBOX_UID_BASE + SANDBOX_SLOTS:
                ipc.add((kind, int(row[header.index("shmid" if kind == "shm" else kind + "id")])))
    with open("/proc/meminfo") as f:
        shmem = next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))
    return Host(frozenset(ipc), shmem)


def leftovers(before: Host, parent_pid: int, uid: Optional[int]) -> dict:
    """What a parent (``parent_pid``) and its program (run as ``uid``, if known) left on the host
    that was ``before``."""
    now = host_now()
    left = {"directories": glob.glob(os.path.join(tempfile.gettempdir(), f"hflow-sandbox-{parent_pid}-*")),
            "ipc": sorted(now.ipc - before.ipc), "processes": [] if uid is None else processes_of(uid),
            "shmem_kib": max(0, now.shmem_kib - before.shmem_kib - SHMEM_SLACK_KIB)}
    return {what: found for what, found in left.items() if found}


def assert_host_back(before: Host, parent_pid: int, uid: Optional[int], settle: float = 5.0) -> None:
    """The host as ``before`` within ``settle`` seconds (a private IPC namespace is freed by a
    kernel worker soon after its last process ends, descriptors in flight by the collector)."""
    deadline = time.monotonic() + settle
    while (left := leftovers(before, parent_pid, uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left on the host: {left}"


def assert_run_left_nothing(before: Host, out: dict) -> None:
    """``assert_host_back`` after the run ``out`` (``run_parent``'s)."""
    assert_host_back(before, out["parent_pid"], NOT_ROOT if out["uid"] is None else out["uid"])


def clean_up(before: Host) -> None:
    """What a failed run left: this machine is shared."""
    for path in sweep_stale(tempfile.gettempdir()):
        print(f"removed {path}, left by a run")
    for kind, ident in host_now().ipc - before.ipc:
        subprocess.run(["ipcrm", {"shm": "-m", "msg": "-q", "sem": "-s"}[kind], str(ident)], capture_output=True)


# ---------------------------------------------------------------- a parent of its own

def run_parent(source: str, tests: list, limits: SandboxLimits = LIMITS, without=(), python: Optional[str] = None,
               user: Optional[int] = None) -> dict:
    """``run_tests`` in a fresh interpreter (``python``, as ``user``): what it returned (or raised),
    its time and its peak memory. A parent that does not return in time is killed, and fails."""
    python = python or readable_python() or sys.executable
    command = [python, "-c", PARENT.format(src=SRC), json.dumps(asdict(limits)), json.dumps(tests),
               json.dumps(list(without))]
    try:
        run = subprocess.run(command, input=source, capture_output=True, text=True, user=user, group=user,
                             timeout=limits.wall_seconds + SLACK + 10, cwd="/")
    except subprocess.TimeoutExpired:
        pytest.fail(f"the parent hung: still in run_tests {limits.wall_seconds + SLACK + 10:g} s after it began")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["seconds"] < limits.wall_seconds + SLACK, out
    assert out["max_rss_kib"] < PARENT_MAX_RSS_KIB, out
    return out


# ---------------------------------------------------------------- the attacks

@dataclass(frozen=True)
class Attack:
    name: str
    limits: SandboxLimits = LIMITS
    bounded_without: tuple = ()
    """Layers whose absence lets it work (score) in the sandbox: the host must still be clean."""
    needs: tuple = ()
    """Modules it needs the sandbox uid to import (none where it cannot read the standard library)."""


ATTACK_LIST = [
    Attack("leave_fifo.py"), Attack("leave_links.py"), Attack("leave_sockets.py"), Attack("unreadable_dirs.py"),
    Attack("deep_tree.py"), Attack("many_files.py", bounded_without=("namespaces",)),
    Attack("big_files.py", bounded_without=("namespaces",)),
    Attack("sysv_ipc.py", bounded_without=("seccomp",), needs=("ctypes",)),
    Attack("memfd.py", SandboxLimits(**{**asdict(LIMITS), "file_size_bytes": 8 << 20}), bounded_without=("seccomp",)),
    Attack("fd_passing.py", SandboxLimits(**{**asdict(LIMITS), "file_size_bytes": 8 << 20}), needs=("socket",)),
    Attack("flood_result.py"),
]
MODES = {"all layers": (), "no namespaces": ("namespaces",), "no seccomp": ("seccomp",)}
# Where a layer's absence matters: every attack meets the host's own directory when the sandbox has
# no mount namespace; those that take memory meet the namespaces alone when seccomp is missing
RUNS = [(a, mode) for a in ATTACK_LIST for mode in MODES
        if mode != "no seccomp" or a.name in ("sysv_ipc.py", "memfd.py", "fd_passing.py")]


@pytest.fixture
def canary():
    """A directory outside the sandbox with a file in it, and a secret only root may read."""
    directory = tempfile.mkdtemp(prefix="hflow-canary-")
    with open(os.path.join(directory, "kept"), "w") as out:
        out.write("kept")
    secret = os.path.join(directory, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as out:
        out.write(f"hflow-secret-{uuid.uuid4().hex}")
    yield directory
    shutil.rmtree(directory)


def attack_source(a: Attack, canary: str) -> str:
    return attack(a.name, prelude=True, target=canary, secret=os.path.join(canary, "secret"),
                  max_files=a.limits.max_files_written, file_bytes=a.limits.file_size_bytes,
                  memory=a.limits.memory_bytes)


@functools.lru_cache(maxsize=None)
def sandbox_can_import(module: str) -> bool:
    """Whether the sandbox uid can import ``module`` under the parent ``run_parent`` uses."""
    out = run_parent(f"import {module}\n", ["pass"], without=("namespaces", "landlock", "seccomp", "audit_hook"))
    return out["passed"] == [True]


@pytest.fixture
def host():
    """The host's state before the test; what the test left, removed after it (the machine is shared)."""
    before = host_now()
    yield before
    clean_up(before)


@pytest.mark.parametrize("a, mode", RUNS, ids=[f"{a.name[:-3]}-{mode.replace(' ', '_')}" for a, mode in RUNS])
def test_the_host_is_as_it_was_after_a_hostile_program(a, mode, canary, host):
    for module in a.needs:
        if not sandbox_can_import(module):
            pytest.skip(f"the sandbox uid cannot import {module} here (no interpreter it can read)")
    tests = [f"assert f({i}) == {2 * i}" for i in range(1, 9)]
    out = run_parent(attack_source(a, canary), tests, a.limits, without=MODES[mode])
    assert "raised" not in out, out
    if not set(MODES[mode]) & set(a.bounded_without):
        assert not any(out["passed"]), f"the attack worked: {out}"
    with open(os.path.join(canary, "secret")) as f:
        assert f.read() not in (out["error"] or ""), "the host's secret came back in the error"
    with open(os.path.join(canary, "kept")) as f:
        assert f.read() == "kept"
    assert not os.path.exists(out["workdir"])
    assert_run_left_nothing(host, out)


@pytest.mark.skipif(not AS_ROOT, reason="runs the parent as another uid")
@pytest.mark.parametrize("name", ["unreadable_dirs.py", "deep_tree.py", "leave_fifo.py"])
@pytest.mark.parametrize("mode", ["all layers", "no namespaces"])
def test_a_parent_that_is_not_root_leaves_nothing_either(name, mode, canary, host):
    # As root the parent may remove what it cannot read; a trainer that is not root must first give
    # itself the rights the program took away (in the same uid: without root, there is no uid drop).
    python = readable_python()
    if python is None:
        pytest.skip("no interpreter that another uid can run")
    out = run_parent(attack_source(Attack(name), canary), ["assert f(1) == 2"], without=MODES[mode], python=python,
                     user=NOT_ROOT)
    assert "raised" not in out, out
    assert out["passed"] == [False] and not os.path.exists(out["workdir"])
    assert_run_left_nothing(host, out)


@pytest.mark.parametrize("name", ["leave_links.py", "leave_fifo.py", "deep_tree.py", "unreadable_dirs.py"])
def test_the_agents_python_tool_leaves_nothing_either(name, canary, host):
    # The tool returns the program's error to the model: an output link to a root-only file put
    # that file there (the tool runs in this process: its directories are named for this pid).
    from hflow.agents import builtin_tools
    text = builtin_tools.python(attack_source(Attack(name), canary))
    with open(os.path.join(canary, "secret")) as f:
        assert f.read() not in text
    assert_host_back(host, os.getpid(), None)  # the uid it ran as is not said: test_code_sandbox.py looks at those


def test_attacks_are_all_run():
    listed = {a.name for a in ATTACK_LIST} | {"README.md", "neuter_audit_hook.py"}
    assert set(os.listdir(ATTACKS)) - {"__pycache__"} == listed | set(FORGERIES) | set(HOOK_ATTACKS)
