"""Run a script under torchrun as a subprocess, with a hard timeout, for multi-process tests."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")  # the torchrun worker programs


def device() -> str:
    """The ranks' HFLOW_DEVICE: the test run's own (scripts/gpu_check.sh sets cuda), else cpu,
    so that the ranks are CPU ranks even on a host with a GPU (hflow.launch would otherwise put
    rank i on cuda:i)."""
    return os.environ.get("HFLOW_DEVICE", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    returncode: int
    output: str
    timed_out: bool

    def check(self):
        """Fail with every rank's output unless the run exited 0."""
        assert not self.timed_out, f"torchrun timed out:\n{self.output}"
        assert self.returncode == 0, f"torchrun exited {self.returncode}:\n{self.output}"
        return self


def script_path(script: str, tmp_path) -> str:
    """`script` itself when it is a path; Python source (it has a newline) is written to a file."""
    if "\n" not in script:
        return script
    assert tmp_path is not None, "pass tmp_path to run inline source"
    path = os.path.join(str(tmp_path), f"script_{free_port()}.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(script))
    return path


def torchrun(script: str, nproc: int, args=(), timeout: float = 300, tmp_path=None, env=None) -> Run:
    """Run `script` (a path, or Python source when it contains a newline) on `nproc` ranks on
    device() (CPU unless HFLOW_DEVICE says otherwise).

    The whole process group is killed at `timeout`, so a deadlock fails the test instead of
    hanging CI.
    """
    script = script_path(script, tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), script, *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "HFLOW_DEVICE": device(), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Run(proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: kill the whole tree, not one group.
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        return Run(-9, out, True)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Ranks:
    """Per-rank outcome of `run_ranks`."""
    returncodes: list[int]
    outputs: list[str]
    elapsed: float           # seconds from start until the last rank ended
    timed_out: bool
    ended_at: list[float]    # time.time() when each rank was seen to end

    @property
    def output(self) -> str:
        return "\n".join(f"===== rank {r} (exit {c}) =====\n{o}"
                         for r, (c, o) in enumerate(zip(self.returncodes, self.outputs)))

    def check(self):
        assert not self.timed_out, f"ranks timed out after {self.elapsed:.0f} s:\n{self.output}"
        assert all(c == 0 for c in self.returncodes), f"a rank failed:\n{self.output}"
        return self


def run_ranks(script: str, nproc: int, args=(), timeout: float = 300, tmp_path=None,
              env=None) -> Ranks:
    """Start `nproc` ranks as plain processes with the environment torchrun would give them,
    but without torchrun's agent: nothing kills the other ranks when one dies, so a test sees
    how the ranks end on their own, each with its own exit code. Any rank still alive at
    `timeout` is killed and the run counts as timed out."""
    import time
    script = script_path(script, tmp_path)
    port = free_port()
    procs, files = [], []
    start = time.monotonic()
    for rank in range(nproc):
        rank_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "HFLOW_DEVICE": device(), **(env or {}),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}
        out = open(os.path.join(str(tmp_path), f"rank{rank}_{port}.log"), "w+") if tmp_path \
            else __import__("tempfile").TemporaryFile("w+")
        files.append(out)
        procs.append(subprocess.Popen([sys.executable, script, *map(str, args)], stdout=out,
                                      stderr=subprocess.STDOUT, text=True, env=rank_env,
                                      start_new_session=True))
    ended_at = [0.0] * nproc
    while any(p.poll() is None for p in procs) and time.monotonic() - start < timeout:
        for rank, proc in enumerate(procs):
            if ended_at[rank] == 0.0 and proc.poll() is not None:
                ended_at[rank] = time.time()
        time.sleep(0.05)
    timed_out = any(p.poll() is None for p in procs)
    for rank, proc in enumerate(procs):
        if ended_at[rank] == 0.0 and proc.poll() is not None:
            ended_at[rank] = time.time()
    elapsed = time.monotonic() - start
    if timed_out:
        for proc in procs:
            for pid in [proc.pid, *_descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            proc.wait()
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    return Ranks([p.returncode for p in procs], outputs, elapsed, timed_out, ended_at)
