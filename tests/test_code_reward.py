"""The code reward's sandbox against hostile programs (each scores 0 within its limit and leaves no
process, file or directory behind), its score on right, wrong and partly right code, batch scoring
in the reward pool, and the built-in code task (its reference solutions pass its asserts)."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from hflow.rewards import get_reward_fn, score_batch
from hflow.rewards import code as code_reward
from hflow.rewards.code import (SANDBOX_SLOTS, SANDBOX_UID_BASE, SandboxLimits, code_score,
                                extract_code, parse_tests, run_tests)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


# ---------------------------------------------------------------- response and tests

@pytest.mark.parametrize("response, code", [
    ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),
    ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
    ("```py\nA = 1\n```", "A = 1\n"),
    ("```\nA = 1\n```", "A = 1\n"),
    ("First:\n```python\nA = 1\n```\nBetter:\n```python\nA = 2\n```", "A = 2\n"),  # the last block
    ("```python\nA = 1\nB = 2", "A = 1\nB = 2"),  # cut off by the token limit: runs to the end
])
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_parse_tests_layouts_and_errors():
    assert parse_tests("assert f(1) == 1\n\nassert f(2) == 2\n") == ["assert f(1) == 1", "assert f(2) == 2"]
    assert parse_tests(["assert f(1) == 1", "x = f(2)\nassert x == 2"]) == ["assert f(1) == 1", "x = f(2)\nassert x == 2"]
    for bad in ("", "\n \n", [], None, 3, [1, 2]):
        with pytest.raises(ValueError, match="--data.answer-key"):
            parse_tests(bad)


# ---------------------------------------------------------------- scores

TESTS = "assert f(1) == 2\nassert f(5) == 10\nassert f(-3) == -6"


@pytest.mark.parametrize("response, score", [
    ("```python\ndef f(x):\n    return 2 * x\n```", 1.0),
    ("def f(x):\n    return x + 1\n", 1 / 3),   # right for f(1) only
    ("def f(x):\n    return x\n", 0.0),
    ("def f(x) return 2 * x", 0.0),            # a syntax error
    ("The answer is 2x.", 0.0),                # no code at all
    ("import math\nfrom collections import Counter\ndef f(x):\n    return int(math.copysign(2 * abs(x), x))\n", 1.0),
])
def test_code_score(response, score):
    out = code_score(response, TESTS)
    assert out["score"] == pytest.approx(score)
    assert out["all_passed"] == float(score == 1.0) and out["timed_out"] == 0.0


def test_a_test_that_raises_fails_alone_and_the_working_directory_is_writable():
    source = ("def f(x):\n    return 10 // x\n"
              "with open('scratch.txt', 'w') as out:\n    out.write('kept')\n")
    result = run_tests(source, ["assert f(2) == 5", "f(0)", "assert open('scratch.txt').read() == 'kept'"])
    assert result.passed == [True, False, True] and result.error is None


# ---------------------------------------------------------------- hostile programs

def test_fork_bomb_is_refused_by_the_audit_hook():
    result = run_hostile("import os\nwhile True:\n    os.fork()\n")
    assert "os.fork" in result.error


def test_fork_bomb_without_the_audit_hook_is_bounded_by_the_process_limit_and_killed_whole():
    # Children leave the process group (setsid) and keep forking: the uid's process limit bounds
    # them, the wall limit stops them, and killing by uid finds those killpg cannot.
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
        result = run_hostile(bomb, audit_hook=False)
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
    # (as root the result file is not even writable: it belongs to root)
    run_hostile("for i in range(3):\n    print(f'test {i} 1')\n"
                "try:\n    open('result', 'a').write('test 0 1\\n')\nexcept OSError:\n    pass\n",
                ["assert False"] * 3)


@pytest.mark.skipif(not AS_ROOT, reason="found by its uid, which only root gives it")
def test_a_program_whose_parent_dies_ends_at_its_own_alarm():
    # The reward pool kills a worker that overruns --reward.timeout, before its wall-time kill.
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "hflow-sandbox-*")))
    parent = subprocess.Popen([sys.executable, "-c", "from hflow.rewards.code import SandboxLimits, run_tests\n"
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
    for path in set(glob.glob(os.path.join(tempfile.gettempdir(), "hflow-sandbox-*"))) - before:
        shutil.rmtree(path)  # the killed parent's


def test_preloading_is_decided_by_what_others_may_read():
    from hflow.rewards._code_child import others_can_read
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
    monkeypatch.setattr(code_reward, "SANDBOX_SLOTS", 1)
    monkeypatch.setattr(code_reward, "SANDBOX_UID_BASE", 2 ** 32 - 1)  # (uid_t) -1: no process can have it
    with pytest.raises(RuntimeError, match="could not set up"):
        run_tests("pass", ["pass"], QUICK)


# ---------------------------------------------------------------- the reward pool

def test_score_batch_in_the_pool_mixes_right_wrong_and_hostile_programs():
    right = "```python\ndef f(x):\n    return 2 * x\n```"
    responses = [right, "def f(x):\n    return x + 1\n", "while True:\n    pass\n",
                 "import os\nos.abort()\n", "def f(x):\n    return 0\n", right]
    result = score_batch(get_reward_fn("code"), responses, [TESTS] * len(responses), num_workers=4)
    assert result.scores == pytest.approx([1.0, 1 / 3, 0.0, 0.0, 0.0, 1.0])
    assert result.failures == [None] * len(responses)  # the sandbox's limits come before the pool's timeout
    assert result.metrics["reward/all_passed"] == pytest.approx(2 / 6)
    assert result.metrics["reward/timed_out"] == pytest.approx(1 / 6)
    assert not sandbox_processes()


# ---------------------------------------------------------------- the built-in code task

def test_code_task_reference_solutions_pass_their_asserts_and_wrong_ones_fail():
    from hflow.data import TASKS, task_splits
    rows = TASKS["code"].problems()
    assert len({r["prompt"] for r in rows}) == len(rows) > 1000
    # A byte-level BPE makes at most one token per byte: the embedded default (256 positions)
    # has room for a 150-token answer after any of these prompts.
    assert max(len(r["prompt"].encode()) for r in rows) <= 100
    for row in rows:  # our own code, run here: the asserts come from an oracle written apart
        namespace = {}
        exec(row["extra"]["solution"], namespace)
        for test in parse_tests(row["answer"]):
            exec(test, namespace)
    train, held_out = task_splits("code", seed=0)  # the default --data.task-eval-size fits
    assert len(held_out) == 500 and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    sample = held_out[:4]
    responses = [r["extra"]["solution"] for r in sample] + ["def f(x):\n    return None\n"]
    result = score_batch(code_score, responses, [r["answer"] for r in sample + sample[:1]], num_workers=2)
    assert result.scores == [1.0, 1.0, 1.0, 1.0, 0.0]
