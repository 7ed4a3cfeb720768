"""The code reward's sandbox against hostile programs (each scores 0 within its limit and leaves no
process, file or directory behind) and against attacks on its boundary and on its result
(tests/attacks: a wrong solution never scores), and its fallbacks when a kernel layer is missing."""
import errno
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from hflow.rewards.code import code_score
from hflow.sandbox import SANDBOX_SLOTS, SANDBOX_UID_BASE, SandboxLimits, run_tests, sandbox_isolation
from hflow.sandbox import uids as sandbox_uids
from hflow.sandbox.workdir import sweep_stale

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attacks")
AS_ROOT = os.geteuid() == 0
QUICK = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=256 << 20, processes=8)
# A hostile program's whole run, start-up and clean-up included, on a loaded 2-core machine.
SLACK = 5.0

pytestmark = pytest.mark.timeout(120)


def sandbox_processes() -> dict[int, int]:
    """pid -> uid of every live process in the sandbox uid range: what a stray would be (as root)."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(status["Uid"].split()[0])
        if status["State"].strip().startswith("Z"):
            continue
        if SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_SLOTS:
            found[int(name)] = uid
    return found


def run_hostile(source: str, tests=("pass",), limits=QUICK, **kwargs):
    start = time.monotonic()
    result = run_tests(source, list(tests), limits, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < limits.wall_seconds + SLACK, f"took {elapsed:.1f} s"
    assert not any(result.passed), result
    assert not os.path.exists(result.workdir)
    assert not sandbox_processes()
    with pytest.raises(ProcessLookupError):  # nothing is left in its process group
        os.killpg(result.pid, 0)
    return result


# ---------------------------------------------------------------- hostile programs

def test_fork_bomb_is_refused_by_the_audit_hook():
    result = run_hostile("import os\nwhile True:\n    os.fork()\n")
    assert "os.fork" in result.error


@pytest.mark.parametrize("without", [("audit_hook",), ("audit_hook", "seccomp")], ids=["seccomp", "nproc"])
def test_fork_bomb_without_the_audit_hook_is_bounded_by_the_process_limit_and_killed_whole(without):
    # seccomp refuses the forks; without it, children leave the process group (setsid) and keep
    # forking: the uid's process limit bounds them, the wall limit stops them, and the end of the
    # pid namespace and killing by uid find those killpg cannot.
    bomb = ("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
            "    except OSError:\n        pass\n")
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(sandbox_processes()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_hostile(bomb, without=without)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out
    if AS_ROOT:
        assert result.uid is not None and 1 < peak[0] <= QUICK.processes
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=60).returncode == 0  # we can still fork


@pytest.mark.parametrize("source", ["while True:\n    pass\n", "import time\ntime.sleep(1000)\n"],
                         ids=["busy", "asleep"])
def test_endless_program_is_stopped_by_its_cpu_or_wall_limit(source):
    result = run_hostile(source)
    assert result.timed_out


def test_memory_hog_gets_memory_error_at_its_limit():
    result = run_hostile("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n")
    assert result.error.startswith("MemoryError") and not result.timed_out


def test_oversized_file_is_cut_at_the_file_size_limit():
    result = run_hostile("with open('big', 'wb') as f:\n    f.write(b'x' * (16 << 20))\n",
                         limits=SandboxLimits(wall_seconds=2.0, file_size_bytes=1 << 20))
    assert "File too large" in result.error


@pytest.mark.parametrize("write", [
    "open({target!r}, 'w').write('escaped')",
    "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
    "import os\nos.mkdir({target!r})",
    "open('mine', 'w').close()\nimport os\nos.rename('mine', {target!r})",
    "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('escaped')",
    "import os\nfd = os.open('/tmp', os.O_RDONLY)\nos.close(os.open('{name}', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
    "import os\nopen(os.path.join(os.getcwd(), '..', '{name}'), 'w').write('escaped')",
], ids=["open", "os.open", "mkdir", "rename", "symlink", "dir_fd", "dotdot"])
@pytest.mark.parametrize("where", ["/tmp", REPO])
def test_writes_outside_the_working_directory_are_refused(write, where):
    name = f"hflow-escape-{uuid.uuid4().hex}"
    target = os.path.join(where, name)
    try:
        run_hostile(write.format(target=target, name=name) + "\nESCAPED = True", ["assert ESCAPED"])
        assert not os.path.lexists(target)
        assert not os.path.lexists(os.path.join("/tmp", name))
    finally:
        for path in (target, os.path.join("/tmp", name)):
            if os.path.isdir(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.remove(path)


def test_the_parents_environment_is_not_visible(monkeypatch):
    secret = f"hflow-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("HFLOW_TEST_SECRET", secret)
    source = ("import os\nseen = dict(os.environ)\n"
              "def leak():\n    found = ' '.join(seen.values())\n"
              "    for path in (f'/proc/{os.getppid()}/environ', '/proc/1/environ'):\n"
              "        try:\n            found += open(path, 'rb').read().decode(errors='replace')\n"
              "        except OSError:\n            pass\n    return found\n")
    result = run_tests(source, [f"assert {secret!r} in leak()",
                                "assert sorted(seen) == ['HOME', 'LANG', 'PATH', 'TMPDIR']"], QUICK)
    assert result.passed == [False, True], result  # it ran, and saw only the minimal environment
    assert not sandbox_processes() and not os.path.exists(result.workdir)


@pytest.mark.parametrize("source, error", [
    ("import os\nos.abort()\n", "SIGABRT"),
    ("import faulthandler\nfaulthandler._sigsegv()\n", "SIGSEGV"),
    ("import ctypes\nctypes.string_at(0)\n", "import ctypes"),   # a segfault via ctypes: refused
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import os\nos._exit(0)\n", "exit code 0"),                   # exits before the tests
    ("import os\nos.system('echo hi')\n", "os.system"),
    ("import os\nos.kill(os.getppid(), 9)\n", "os.kill"),
])
def test_crashing_program_scores_zero(source, error):
    result = run_hostile(source)
    assert error in result.error


def test_a_program_that_prints_result_lines_cannot_forge_them():
    run_hostile("for i in range(3):\n    print(f'test {i} 1')\n"
                "try:\n    open('result', 'a').write('test 0 1\\n')\nexcept OSError:\n    pass\n",
                ["assert False"] * 3)


@pytest.mark.skipif(not AS_ROOT, reason="found by its uid, which only root gives it")
def test_a_program_whose_parent_dies_ends_at_its_own_alarm():
    # The reward pool kills a worker that overruns --reward.timeout, before its wall-time kill.
    parent = subprocess.Popen([sys.executable, "-c", "from hflow.sandbox import SandboxLimits, run_tests\n"
                               "run_tests('import time\\ntime.sleep(1000)', ['pass'], SandboxLimits(wall_seconds=3))"])
    try:
        deadline = time.monotonic() + 60
        while not sandbox_processes():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        parent.kill()
        parent.wait()
    orphaned = time.monotonic()
    while sandbox_processes():
        assert time.monotonic() - orphaned < 3 + 1 + SLACK, sandbox_processes()
        time.sleep(0.05)
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), f"hflow-sandbox-{parent.pid}-*")))
    assert len(left) == 1  # the killed parent's, which the next process's first run sweeps
    assert set(sweep_stale(tempfile.gettempdir())) >= left and not any(map(os.path.lexists, left))


def test_preloading_is_decided_by_what_others_may_read():
    from hflow.sandbox.child import others_can_read
    outer = tempfile.mkdtemp()
    try:
        inner = os.path.join(outer, "lib")
        os.mkdir(inner)
        os.chmod(inner, 0o755)
        os.chmod(outer, 0o755)
        assert others_can_read(inner)
        os.chmod(outer, 0o750)  # like /root: the directory below it cannot be reached
        assert not others_can_read(inner)
        os.chmod(outer, 0o755)
        os.chmod(inner, 0o711)  # reachable, not listable
        assert not others_can_read(inner)
    finally:
        shutil.rmtree(outer)


@pytest.mark.skipif(not AS_ROOT, reason="the uid drop happens only as root")
def test_a_uid_the_sandbox_cannot_take_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sandbox_uids, "SANDBOX_SLOTS", 1)
    monkeypatch.setattr(sandbox_uids, "SANDBOX_UID_BASE", 2 ** 32 - 1)  # (uid_t) -1: no process can have it
    with pytest.raises(RuntimeError, match="could not set up"):
        run_tests("pass", ["pass"], QUICK)


# ---------------------------------------------------------------- attacks (tests/attacks)

def attack(name: str, prelude: bool = False, **fill) -> str:
    """The hostile solution tests/attacks/<name>, after the audit-hook prelude if asked, with
    ``__KEY__`` replaced by ``fill[key]``."""
    texts = []
    for part in ["neuter_audit_hook.py", name] if prelude else [name]:
        with open(os.path.join(ATTACKS, part)) as f:
            texts.append(f.read())
    source = "\n".join(texts)
    for key, value in fill.items():
        source = source.replace(f"__{key.upper()}__", str(value))
    return source


class Listener:
    """A TCP listener on the host's 127.0.0.1 that records what anyone sends it."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self.received, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._accept)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.received.append(conn.recv(100) or b"(connected)")
                except OSError:
                    self.received.append(b"(connected)")

    def close(self):
        self._stop.set()
        self._thread.join()
        self.server.close()


DOUBLES = ["assert f(1) == 2", "assert f(5) == 10", "assert f(-3) == -6"]
HONEST = "def f(x):\n    return 2 * x\n"
KERNEL_LAYERS = ("namespaces", "landlock", "seccomp")
HOOK_ATTACKS = ["hook_bash.py", "hook_socket.py", "hook_tmp_write.py", "hook_fork.py"]
FORGERIES = ["frame_token.py", "result_fd.py", "patched_reporter.py", "patched_compile.py", "always_equal.py",
             "oracle_hunt.py"]


@pytest.fixture
def kernel_layers():
    """Skips where this machine's sandbox lacks a kernel layer (no user namespaces, an old kernel)."""
    line = sandbox_isolation()
    if not ("user+pid+net+ipc+mount namespaces" in line and "landlock ABI" in line and "no seccomp" not in line):
        pytest.skip(f"the sandbox here lacks kernel layers: {line}")


def test_the_attack_prelude_neuters_the_audit_hook():
    # os.kill is refused by the hook alone (the kernel lets a process signal itself): the hook_*
    # attacks below meet the layers under the hook, which must hold on their own.
    source = attack("neuter_audit_hook.py") + "\nimport os\nos.kill(os.getpid(), 0)\n" + HONEST
    assert run_tests(source, DOUBLES, QUICK).passed == [True] * 3
    assert "os.kill" in run_tests("import os\nos.kill(os.getpid(), 0)\n", ["pass"], QUICK).error


def run_hook_attack(name: str, without=(), hostile=True) -> None:
    """Run a hook_* attack; its effects (a file in the host's /tmp, a connection to a listener on
    the host's 127.0.0.1, a process left behind) must not show, and (``hostile``) it must score 0."""
    target = os.path.join("/tmp", f"hflow-escape-{uuid.uuid4().hex}")
    listener = Listener()
    try:
        source = attack(name, prelude=True, target=target, port=listener.port)
        if hostile:
            run_hostile(source, DOUBLES, without=without)
        else:
            result = run_tests(source, DOUBLES, QUICK, without=without)
            assert not sandbox_processes() and not os.path.exists(result.workdir)
        time.sleep(0.2)  # a connection would have been accepted by now
        assert listener.received == []
        assert not os.path.lexists(target)
    finally:
        listener.close()
        if os.path.lexists(target):
            os.remove(target)


@pytest.mark.parametrize("name", HOOK_ATTACKS)
def test_a_program_past_the_audit_hook_is_held_by_the_kernel(name, kernel_layers):
    run_hook_attack(name)


@pytest.mark.parametrize("left_out", KERNEL_LAYERS)
@pytest.mark.parametrize("name", HOOK_ATTACKS)
def test_any_one_kernel_layer_may_be_missing(name, left_out, kernel_layers):
    # bash may then run, or fork work (hook_fork without seccomp scores): inside, with no effect out
    run_hook_attack(name, without=(left_out,), hostile=False)


@pytest.mark.parametrize("without", [(), KERNEL_LAYERS], ids=["all layers", "no kernel layers"])
@pytest.mark.parametrize("name", FORGERIES)
def test_a_wrong_solution_cannot_forge_its_result(name, without):
    # The expected value is found nowhere but in the tests: in no layer of the sandbox either.
    expected = f"hflow-expected-{uuid.uuid4().hex}"
    tests = [f"assert f(1) == {expected!r}", "assert f(2) == 4", "assert f(3) in (9, 10)",
             "assert abs(f(4) - 16) < 1e-9", f"assert f(5).startswith({expected!r})"]
    source = attack(name, prelude=name == "oracle_hunt.py")
    run_hostile(source, tests, without=without)
    assert code_score(source, tests)["score"] == 0.0


def test_the_seccomp_filter_refuses_exec_sockets_processes_and_namespaces(kernel_layers):
    # Run here (the sandbox uid may not reach the socket module): the filter alone, and threads still start.
    outcomes = run_python("""
        import os, socket, threading
        from hflow.sandbox import isolation
        isolation.seccomp(refuse_processes=True)
        outcomes = {}
        for what, step in [("socket", socket.socket), ("exec", lambda: os.execv("/bin/true", ["true"])),
                           ("fork", os.fork), ("unshare", isolation.enter_namespaces)]:
            try:
                step()
                outcomes[what] = "allowed"
            except OSError as e:
                outcomes[what] = e.errno
        thread = threading.Thread(target=outcomes.setdefault, args=("thread", "allowed"))
        thread.start()
        thread.join()
        print(outcomes)""")
    assert outcomes == {"socket": errno.EPERM, "exec": errno.EPERM, "fork": errno.EPERM,
                        "unshare": errno.EPERM, "thread": "allowed"}


def test_the_seccomp_filter_refuses_memory_the_address_space_limit_does_not_count(kernel_layers):
    # System V IPC (on the host's IPC namespace where the sandbox has none, and outliving the
    # program), POSIX message queues, memfd files, socket pairs (descriptors in flight); what the
    # filter let through is removed at once: this runs on the host.
    outcomes = run_python("""
        import ctypes, os, socket
        from hflow.sandbox import isolation
        libc = ctypes.CDLL(None, use_errno=True)
        numbers = isolation._SYSCALLS[os.uname().machine][1]
        IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0

        def call(name, *args):
            result = libc.syscall(ctypes.c_long(numbers[name]), *args)
            if result == -1:
                raise OSError(ctypes.get_errno(), name)
            return result
        isolation.seccomp(refuse_processes=True)
        outcomes = {}
        for what, make, undo in [
                ("shmget", lambda: call("shmget", IPC_PRIVATE, ctypes.c_size_t(4096), IPC_CREAT | 0o600),
                 lambda i: libc.shmctl(i, IPC_RMID, None)),
                ("msgget", lambda: call("msgget", IPC_PRIVATE, IPC_CREAT | 0o600), lambda i: libc.msgctl(i, IPC_RMID, None)),
                ("semget", lambda: call("semget", IPC_PRIVATE, 1, IPC_CREAT | 0o600), lambda i: libc.semctl(i, 0, IPC_RMID)),
                ("mq_open", lambda: call("mq_open", b"hflow-seccomp-test", os.O_CREAT | os.O_RDWR, 0o600, None),
                 lambda fd: libc.mq_unlink(b"/hflow-seccomp-test")),
                ("memfd_create", lambda: os.memfd_create("held"), os.close),
                ("socketpair", socket.socketpair, lambda pair: [s.close() for s in pair])]:
            try:
                undo(make())
                outcomes[what] = "allowed"
            except OSError as e:
                outcomes[what] = e.errno
        print(outcomes)""")
    assert outcomes == dict.fromkeys(["shmget", "msgget", "semget", "mq_open", "memfd_create", "socketpair"],
                                     errno.EPERM)


def test_landlock_confines_writes_reads_and_tcp_to_the_working_directory(kernel_layers):
    listener = Listener()
    workdir = tempfile.mkdtemp()
    outside = os.path.join("/tmp", f"hflow-escape-{uuid.uuid4().hex}")
    try:
        outcomes = run_python(f"""
            import os, socket, sys
            from hflow.sandbox import isolation
            isolation.landlock({workdir!r}, sorted({{os.path.realpath(p) for p in sys.path if p}}), ["/dev/null"])
            outcomes = {{}}
            for what, step in [("write inside", lambda: open(os.path.join({workdir!r}, "kept"), "w").close()),
                               ("write outside", lambda: open({outside!r}, "w").close()),
                               ("read outside", lambda: open({os.path.abspath(__file__)!r}).read()),
                               ("read the standard library", lambda: open(os.__file__).read()),
                               ("connect", lambda: socket.create_connection(("127.0.0.1", {listener.port}), 2))]:
                try:
                    step()
                    outcomes[what] = "allowed"
                except OSError as e:
                    outcomes[what] = e.errno
            print(outcomes)""")
        assert outcomes == {"write inside": "allowed", "write outside": errno.EACCES, "read outside": errno.EACCES,
                            "read the standard library": "allowed", "connect": errno.EACCES}
        assert not os.path.lexists(outside) and listener.received == []
    finally:
        listener.close()
        shutil.rmtree(workdir)


def run_python(code: str):
    """What a fresh interpreter running ``code`` (dedented) prints, evaluated."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)


# ---------------------------------------------------------------- fallbacks and the start-up line

@pytest.mark.parametrize("without", [(), ("namespaces",), ("landlock",), ("seccomp",), KERNEL_LAYERS,
                                     KERNEL_LAYERS + ("audit_hook",)])
def test_an_honest_program_scores_whatever_layers_the_kernel_allows(without):
    result = run_tests(HONEST, DOUBLES, QUICK, without=without)
    assert result.passed == [True] * 3 and result.error is None, result
    for layer in without:
        assert f"no {layer.replace('_', ' ')} (left out)" in result.isolation
    assert "rlimits" in result.isolation and ("uid drop" in result.isolation.split(", ")) == AS_ROOT


def test_unknown_layers_are_refused():
    with pytest.raises(ValueError, match="unknown layers"):
        run_tests(HONEST, DOUBLES, QUICK, without=("landlok",))


def test_the_scorer_says_which_isolation_the_code_sandbox_has(capsys):
    from hflow.rewards import RewardConfig, Scorer
    Scorer(RewardConfig(fn="code")).close()
    assert capsys.readouterr().out == f"hflow: code sandbox: {sandbox_isolation()}\n"
    Scorer(RewardConfig(fn="arithmetic")).close()
    assert capsys.readouterr().out == ""
