"""What every rank runs to serve the controller: one executor thread, calls in issue order.

RPC hands incoming messages to a pool of threads, so two calls sent to one rank can start in
either order — and two ranks that start two collectives in different orders deadlock. So the
controller numbers the tasks it sends to each rank (0, 1, 2, ...) and this server runs them
strictly in that order on a single thread, whatever order they arrive in. Since every rank
runs its tasks in the order the one controller issued them, collectives inside worker methods
(and process-group creation, which is collective) always line up across ranks.

Three messages skip the queue and are answered on the RPC thread at once: `ping` (the
controller's heartbeat, which also tells this rank the controller is alive), `abort`
(the run failed somewhere: exit non-zero now, even if the executor is stuck in a collective),
and `notice` (a worker method marked @dispatch("notice"), which only records something, so that
the call the executor is running can see it: a rollout told that new weights are ready).
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import traceback

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from hflow.batch import Batch
from hflow.distributed import byte_counters
from hflow.distributed.parallel import release_freed_memory
from hflow.runtime.host_memory import LowWater


# ---- the tasks the controller sends (hflow.runtime.controller) --------------------------------------------

@dataclass
class Spawn:
    """Build a group's mesh (every rank: process-group creation is collective) and, on its
    members, `worker_class(mesh, *args, **kwargs)`; other ranks get worker_class None."""
    group_id: int
    grid: Any                    # hflow.runtime.dispatch.RankGrid
    device_type: str
    worker_class: type | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Call:
    """Run `method(*args, **kwargs)` on this rank's worker of the group; `returns` False: send
    nothing back (a tensor-parallel peer's duplicate result)."""
    group_id: int
    method: str
    args: tuple
    kwargs: dict
    returns: bool = True


@dataclass
class Release:
    """Drop this rank's worker of the group (its model, optimizer and engine go with it)."""
    group_id: int


@dataclass
class Stop:
    """The run is over: finish, then leave."""


class Server:
    def __init__(self, rank: int, device: torch.device, threads: int | None = None):
        """threads: the intra-op threads of the worker calls (torch.set_num_threads on the
        executor's thread: OpenMP's count is per calling thread); None: as the thread starts."""
        self.rank, self.device, self.threads = rank, device, threads
        self.workers: dict[int, object] = {}         # group id -> worker object on this rank
        self._meshes: dict[tuple, DeviceMesh] = {}   # (grid, device type) -> mesh
        self._queue: dict[int, tuple] = {}           # seq -> (task, future)
        self._next_seq = 0
        self._cv = threading.Condition()
        self.stopped = threading.Event()
        self.last_ping = time.monotonic()
        self.last_call = "none yet"                  # for the log line when the controller goes silent
        self.count_comm = byte_counters.counting_enabled()
        self._thread = threading.Thread(target=self._loop, name=f"hflow-rank{rank}", daemon=True)
        self._thread.start()

    # ---- entry points ----------------------------------------------------------------------
    def handle(self, message) -> torch.futures.Future:
        """Called on an RPC thread for every message; never blocks."""
        kind = message[0]
        if kind == "task":
            return self.submit(message[1], message[2])
        future = torch.futures.Future()
        if kind == "notice":
            self.notice(message[1], future)
        elif kind == "ping":
            self.last_ping = time.monotonic()
            future.set_result("pong")
        elif kind == "abort":
            log(f"hflow rank {self.rank}: stopped by the controller: {message[1]}")
            future.set_result(None)
            # exit a moment later, so that the reply reaches the controller first
            threading.Timer(0.2, hard_exit).start()
        else:
            future.set_exception(ValueError(f"unknown message {kind!r}"))
        return future

    def notice(self, call: Call, future: torch.futures.Future) -> None:
        """Run a @dispatch("notice") method here and now, beside the executor's call."""
        try:
            worker = self.workers.get(call.group_id)
            if worker is None:
                raise RuntimeError(f"{call.method}: no worker of that group on rank {self.rank}")
            future.set_result(("ok", getattr(worker, call.method)(*call.args, **call.kwargs)))
        except Exception as e:
            future.set_result(("err", self.rank, "".join(traceback.format_exception(e))))

    def submit(self, seq: int, task) -> torch.futures.Future:
        future = torch.futures.Future()
        with self._cv:
            self._queue[seq] = (task, future)
            self._cv.notify()
        return future

    def serve(self, controller_timeout_s: float, controller: ProcessIdentity | None = None) -> None:
        """Block until the controller says stop. Exit non-zero if it goes silent (died or
        frozen); a frozen controller on this host is SIGKILLed first, as nothing else ends it."""
        self.last_ping = time.monotonic()
        memory = LowWater(window_s=controller_timeout_s + 30)
        while not self.stopped.wait(timeout=1.0):
            memory.sample()
            silent = time.monotonic() - self.last_ping
            if silent > controller_timeout_s:
                log(f"hflow rank {self.rank}: no heartbeat from the controller (rank 0) for "
                    f"{silent:.0f} s; it died or is frozen. This rank's last call from it: "
                    f"{self.last_call}.{memory.explain('rank 0')} Exiting.")
                kill_if_local(controller, "the controller (rank 0)")
                hard_exit()

    # ---- the executor ----------------------------------------------------------------------
    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # the current device is per thread
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                while self._next_seq not in self._queue:
                    self._cv.wait()
                task, future = self._queue.pop(self._next_seq)
                self._next_seq += 1
            self.last_call = f"{self.describe(task)} (started {time.strftime('%H:%M:%S')}, running)"
            try:
                reply = ("ok", self._run(task))
            except BaseException as e:
                # start the traceback at the worker's code, below this loop and _run
                tb = e.__traceback__
                for _ in range(2):
                    tb = tb.tb_next or tb
                reply = ("err", self.rank, "".join(traceback.format_exception(type(e), e, tb)))
            if isinstance(task, Stop):
                self.stopped.set()
            self.last_call = self.last_call.replace("running", "finished")
            future.set_result(reply)
            if isinstance(task, Stop):
                return

    def describe(self, task) -> str:
        if isinstance(task, Call):
            return f"{type(self.workers.get(task.group_id)).__name__}.{task.method}"
        if isinstance(task, Spawn):
            return f"spawn {task.worker_class.__name__ if task.worker_class else 'a mesh'}"
        return type(task).__name__

    def _run(self, task):
        if isinstance(task, Call):
            worker = self.workers.get(task.group_id)
            if worker is None:
                raise RuntimeError(f"{task.method}: this worker group was released (group.close())")
            with byte_counters.process_bytes if self.count_comm else contextlib.nullcontext():
                out = getattr(worker, task.method)(*task.args, **task.kwargs)
            return to_cpu(out) if task.returns else None
        if isinstance(task, Spawn):
            mesh = self._mesh(task.grid, task.device_type)
            if task.worker_class is not None:
                self.workers[task.group_id] = task.worker_class(mesh, *task.args, **task.kwargs)
            return None
        if isinstance(task, Release):
            self.workers.pop(task.group_id, None)
            gc.collect()   # the reference cycles a released model holds (its hooks), then its memory back
            release_freed_memory(self.device)
            return None
        if isinstance(task, Stop):
            return None
        raise ValueError(f"unknown task {task!r}")

    def _mesh(self, grid, device_type: str) -> DeviceMesh:
        """One DeviceMesh (one set of process groups) per distinct grid: colocated groups
        with the same grid share it. Every rank sees every spawn, so every rank makes the
        same create-or-reuse decision and the collective group creation lines up."""
        key = (grid, device_type)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh(device_type, grid.array,
                                           mesh_dim_names=grid.dim_names)
        return self._meshes[key]


# ---- ending a frozen peer -----------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessIdentity:
    """A rank's process, as every rank records it at start, precisely enough to signal it safely:
    a pid names that process only within one pid namespace of one boot of one kernel (containers
    on a host may share its hostname, not their pids), and only while it lives (a pid is reused
    after). A part /proc does not give (not Linux) is None, and then the process is never killed."""
    pid: int
    boot_id: str | None         # /proc/sys/kernel/random/boot_id: this boot of this machine
    pid_namespace: int | None   # the inode of /proc/<pid>/ns/pid: the namespace the pid counts in
    start_time: int | None      # field 22 of /proc/<pid>/stat: clock ticks after boot


def process_identity(pid: int) -> ProcessIdentity:
    if not _proc_counts_our_pids():
        return ProcessIdentity(pid, None, None, None)
    return ProcessIdentity(pid, _boot_id(), _pid_namespace(pid), _start_time(pid))


def _proc_counts_our_pids() -> bool:
    """Whether /proc is this pid namespace's (a container may see its host's): else /proc/<pid>
    is some other process."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def this_process() -> ProcessIdentity:
    return process_identity(os.getpid())


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 2, the program's name in parentheses, may itself hold spaces and ')': count the
    # fields after the last ')', which start at field 3
    return int(stat[stat.rindex(")") + 1:].split()[22 - 3])


def _reachable_by_pid(peer: ProcessIdentity | None) -> bool:
    """Whether `peer`'s pid means the same thing here: the same boot and pid namespace, and
    not this process; False wherever either identity is incomplete."""
    me = this_process()
    if peer is None or peer.pid == me.pid:
        return False
    pid_space = (peer.boot_id, peer.pid_namespace)
    return None not in (*pid_space, peer.start_time) and pid_space == (me.boot_id, me.pid_namespace)


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (Linux 5.3+), or None where the kernel or a seccomp filter has none.
    Raises ProcessLookupError when no process has the pid."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        return None


def _kill_if_still(peer: ProcessIdentity) -> bool:
    """SIGKILL `peer` if the process that has its pid is the one that registered (the same start
    time), and say whether it was. The pidfd, opened before the comparison, holds on to the
    process compared: a pid reused after it is not the one signalled."""
    pidfd = _pidfd(peer.pid)
    try:
        if _start_time(peer.pid) != peer.start_time:
            return False
        if pidfd is None:
            os.kill(peer.pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def kill_if_local(peer: ProcessIdentity | None, who: str) -> None:
    """SIGKILL a peer process that stopped answering, when it is certainly that process and
    reachable from here: a frozen process (SIGSTOP, a hung driver call) cannot end itself, and
    torchrun's agent would wait 30 s after its SIGTERM before killing it. Anything less certain
    (another machine or container, a reused pid, an identity /proc could not give) is left alone."""
    if not _reachable_by_pid(peer):
        return
    try:
        if _kill_if_still(peer):
            log(f"hflow: SIGKILLed {who} (pid {peer.pid}), which had stopped answering")
    except (ProcessLookupError, PermissionError):
        pass


def to_cpu(x):
    """Results cross RPC as CPU tensors (detached)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, Batch):
        return Batch({k: to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in x.items()},
                     to_cpu(x.meta))
    if isinstance(x, (list, tuple)) and any(isinstance(v, (torch.Tensor, Batch)) for v in x):
        items = [to_cpu(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def hard_exit(code: int = 1) -> None:
    """Exit now, without joining threads that may be stuck in a collective or in RPC."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
