"""The single controller: worker groups, their calls as futures, failure and shutdown.

    def main(cluster: hflow.Cluster, cfg):            # runs on rank 0 only
        critic = cluster.spawn(Critic, cfg.critic, ranks=[2, 3])
        values = critic.values(batch)                   # blocks; dispatched by @dispatch
        pending = critic.update.future(batch)           # returns at once; .result() waits

`hflow.launch` (launcher.py) starts the ranks and hands rank 0 a Cluster; the other ranks serve
its calls (server.py), in the order rank 0 issued them.

Failure model: the first error anywhere (a worker raised, a rank stopped answering) fails the
call that hit it and every other pending or later call with a `RemoteError` naming the rank and
carrying its traceback; when `main` ends that way, rank 0 tells every rank to exit and all of
them exit with status 1 within seconds. A rank that dies is found by its RPC connection
closing or by the controller's heartbeat (every HFLOW_HEARTBEAT_S=2 s; a rank that does not
answer within HFLOW_PEER_TIMEOUT_S=10 s counts as frozen or dead); workers exit on their own when
the controller is silent for HFLOW_CONTROLLER_TIMEOUT_S=15 s. The message names the rank that
stopped answering and the call it was running. A frozen process (SIGSTOP, a stuck driver) cannot
end itself, so the rank that finds it SIGKILLs it when both run on one host; otherwise torchrun's
agent ends it. Pings are answered on RPC threads, so a long call does not look like a hang; only a
process that holds the GIL for longer than the timeout would (raise the timeouts then). Nothing
waits forever.
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import itertools
import os
import threading
import time
import traceback
from typing import Any, Callable

import torch

from hflow.batch import Batch

from . import transport
from .dispatch import RankGrid, balances, gather, mode_of, scatter
from .host_memory import LowWater
from .server import Call, ProcessIdentity, Release, Server, Spawn, Stop, hard_exit, kill_if_local, log, to_cpu


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class RemoteError(RuntimeError):
    """A worker call failed on `rank`; `remote_traceback` is the worker's traceback."""

    def __init__(self, rank: int, what: str, remote_traceback: str):
        self.rank, self.what, self.remote_traceback = rank, what, remote_traceback
        super().__init__(f"{what} failed on rank {rank}; its traceback:\n"
                         f"{remote_traceback.rstrip()}")

    def __reduce__(self):
        return RemoteError, (self.rank, self.what, self.remote_traceback)


class Future:
    """A call in flight. `result(timeout=None)` waits and returns what the blocking call
    would have returned (or raises its RemoteError); `done()` does not wait."""

    def __init__(self, what: str, ranks: list[int], combine: Callable[[dict], Any]):
        self.what = what
        self._combine = combine
        self._missing = set(ranks)
        self._parts: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._inner: concurrent.futures.Future = concurrent.futures.Future()
        self._value, self._combined = None, False

    def result(self, timeout: float | None = None):
        self._inner.result(timeout)   # raises the call's RemoteError
        with self._lock:   # combine once, on the caller's thread (concatenation can be big)
            if not self._combined:
                self._value, self._combined = self._combine(self._parts), True
                self._parts = {}
        return self._value

    def done(self) -> bool:
        return self._inner.done()

    def _part(self, rank: int, value) -> None:
        with self._lock:
            self._parts[rank] = value
            self._missing.discard(rank)
            if not self._missing and not self._inner.done():
                self._inner.set_result(None)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._inner.done():
                self._inner.set_exception(error)

    def __repr__(self):
        return f"<hflow.Future {self.what} {'done' if self.done() else 'pending'}>"


class RemoteMethod:
    """`group.method(*args)` blocks; `group.method.future(*args)` returns a Future."""

    def __init__(self, group: "WorkerGroup", name: str, mode: str, balance: Callable | None = None):
        self.group, self.name, self.mode, self.balance = group, name, mode, balance

    def __call__(self, *args, **kwargs):
        return self.future(*args, **kwargs).result()

    def future(self, *args, **kwargs) -> Future:
        g = self.group
        calls, ctx = scatter(self.mode, g.grid, to_cpu(args), to_cpu(kwargs), self.balance)
        tasks = {c.rank: Call(g.group_id, self.name, c.args, c.kwargs, c.returns) for c in calls}
        return g.cluster._issue(f"{g.worker_class.__name__}.{self.name}", tasks,
                                lambda parts: gather(self.mode, g.grid, ctx, parts), notice=self.mode == "notice")

    def __repr__(self):
        return f"<{self.group.worker_class.__name__}.{self.name} @dispatch({self.mode!r}) " \
               f"on ranks {self.group.ranks}>"


class WorkerGroup:
    """Handle to one worker object per rank of a mesh; its @dispatch methods are attributes."""

    def __init__(self, cluster: "Cluster", group_id: int, worker_class: type, grid: RankGrid):
        self.cluster, self.group_id = cluster, group_id
        self.worker_class, self.grid = worker_class, grid
        self.closed = False

    @property
    def ranks(self) -> list[int]:
        return self.grid.ranks

    def close(self) -> None:
        """Free the group's workers on every rank — models, optimizers, engines — once the
        calls issued before have run. A call on the group afterwards raises."""
        if not self.closed:
            self.closed = True
            self.cluster._issue(f"{self.worker_class.__name__} close", {r: Release(self.group_id) for r in self.ranks},
                                lambda parts: None).result()

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        if self.closed:
            raise RuntimeError(f"{self.worker_class.__name__}.{name}: this worker group was released "
                               f"with close(); spawn a new one")
        fn = getattr(self.worker_class, name, None)
        if fn is None:
            raise AttributeError(f"{self.worker_class.__name__} has no method {name!r}")
        mode = mode_of(fn)
        if mode is None:
            raise AttributeError(f"{self.worker_class.__name__}.{name} is not callable from the "
                                 f"controller: decorate it with @dispatch('all'|'dp'|'one') "
                                 f"(from hflow.runtime.dispatch import dispatch)")
        return RemoteMethod(self, name, mode, balances(fn))

    def __dir__(self):
        return [n for n in dir(self.worker_class) if mode_of(getattr(self.worker_class, n, None))]

    def __repr__(self):
        return f"<WorkerGroup {self.worker_class.__name__} mesh {self.grid.shape} " \
               f"{self.grid.dim_names} on ranks {self.ranks}>"


class Cluster:
    """The controller's view of all ranks. Made by `launch`; `main` receives it."""

    def __init__(self, world_size: int, device: torch.device, server: Server,
                 peers: dict[int, ProcessIdentity] | None = None):
        self.world_size, self.device = world_size, device
        self._server = server                  # rank 0's own executor (it is a worker too)
        self._seq = [0] * world_size           # next task number, per destination rank
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._failure: BaseException | None = None
        self._group_ids = itertools.count()
        self._closing = threading.Event()
        self._aborting = threading.Lock()
        self._peers = peers or {}             # rank -> its process, to end a frozen rank
        self._outstanding: dict[int, dict[int, tuple[str, float]]] = {r: {} for r in range(world_size)}
        if world_size > 1:
            threading.Thread(target=self._heartbeat, name="hflow-heartbeat", daemon=True).start()

    @property
    def device_type(self) -> str:
        return self.device.type

    def spawn(self, worker_class: type, *args, ranks=None, mesh_shape=None,
              mesh_dim_names=("dp",), **kwargs) -> WorkerGroup:
        """Construct `worker_class(mesh, *args, **kwargs)` on each rank of `ranks` (default:
        all), where `mesh` is that rank's DeviceMesh: `ranks` reshaped to `mesh_shape`
        (default 1-D) with dims `mesh_dim_names`. Blocks until every rank has built it."""
        ranks = list(range(self.world_size)) if ranks is None else [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"spawn: ranks {ranks} must be distinct ranks of "
                             f"0..{self.world_size - 1}")
        check = getattr(worker_class, "check_arguments", None)
        if check is not None:
            check(len(ranks), *args, **kwargs)
        shape = (len(ranks),) if mesh_shape is None else tuple(mesh_shape)
        grid = RankGrid.of(ranks, shape, tuple(mesh_dim_names))
        group_id = next(self._group_ids)
        # every rank builds the mesh (process-group creation is collective over the world);
        # only members get the class and arguments
        member = Spawn(group_id, grid, self.device_type, worker_class, to_cpu(args), to_cpu(kwargs))
        tasks = {r: member if r in ranks else Spawn(group_id, grid, self.device_type)
                 for r in range(self.world_size)}
        self._issue(f"spawn {worker_class.__name__}", tasks, lambda parts: None).result()
        return WorkerGroup(self, group_id, worker_class, grid)

    # ---- issuing calls ---------------------------------------------------------------------
    def _issue(self, what: str, tasks: dict[int, tuple], combine, notice: bool = False) -> Future:
        """Send each rank its task, numbered in this rank's order of calls; a `notice` (a
        @dispatch("notice") call) is not numbered: it runs on arrival, beside the queue."""
        future = Future(what, list(tasks), combine)
        sent, error = [], None
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._pending.add(future)
            for rank, task in tasks.items():   # under the lock: one total order of calls
                seq = None
                if not notice:
                    seq = self._seq[rank]
                    self._seq[rank] += 1
                    self._outstanding[rank][seq] = (what, time.monotonic())
                if rank == self._server.rank:
                    # local: copy, so rank 0's worker never shares objects with the controller
                    mine = _private_copy(task)
                    sent.append((rank, seq, self._server.handle(("notice", mine)) if notice
                                 else self._server.submit(seq, mine)))
                    continue
                try:
                    sent.append((rank, seq, transport.send(rank, ("notice", task) if notice else ("task", seq, task))))
                except Exception as e:   # e.g. the peer is already gone
                    error = RemoteError(rank, what, f"could not send the call to rank {rank}: "
                                        f"{e}\n(arguments must be picklable, and worker classes "
                                        f"defined at module level)")
                    break
        if error is not None:
            self._fail(error)
        # callbacks outside the lock: one of them may run right here if its reply is in
        for rank, seq, reply in sent:
            reply.add_done_callback(lambda f, rank=rank, seq=seq: self._on_reply(future, rank, seq, f))
        return future

    def _on_reply(self, future: Future, rank: int, seq: int, reply) -> None:
        # runs on an RPC thread (or rank 0's executor): never let an exception escape, or the
        # call would never complete
        self._outstanding[rank].pop(seq, None)
        try:
            status, *body = reply.value()
        except Exception as e:
            return self._fail(RemoteError(rank, future.what, f"no reply from rank {rank}: {e}\n"
                                          f"Either the rank died (see its output) or its result "
                                          f"could not be sent (results must be picklable)."))
        if status == "err":
            return self._fail(RemoteError(body[0], future.what, body[1]))
        try:
            value = _private_copy(body[0]) if rank == self._server.rank else body[0]
        except Exception:
            return self._fail(RemoteError(rank, future.what,
                                          "the result could not be copied (results must be "
                                          "picklable):\n" + traceback.format_exc()))
        future._part(rank, value)
        if future.done():
            with self._lock:
                self._pending.discard(future)

    def _fail(self, error: BaseException) -> None:
        """The first failure ends the run: fail every pending call (its peers may be stuck in a
        collective waiting for the rank that failed) and refuse new ones."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            pending, self._pending = list(self._pending), set()
        for future in pending:
            future._fail(self._failure)

    # ---- liveness --------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        interval = env_float("HFLOW_HEARTBEAT_S", 2.0)
        timeout = env_float("HFLOW_PEER_TIMEOUT_S", 10.0)
        memory = LowWater(window_s=timeout + 30)
        while not self._closing.wait(interval):
            memory.sample()
            pings = {}
            for rank in range(self.world_size):
                if rank != self._server.rank:
                    try:
                        pings[rank] = transport.send(rank, ("ping",), timeout_s=timeout)
                    except Exception as e:
                        pings[rank] = e
            for rank, ping in pings.items():
                try:
                    if isinstance(ping, Exception):
                        raise ping
                    ping.wait()
                except Exception as e:
                    if self._closing.is_set():
                        return
                    doing = self.doing(rank)
                    log(f"hflow: rank {rank} stopped answering: no reply to a heartbeat within "
                        f"{timeout:.0f} s ({type(e).__name__}); {doing}. It is frozen or dead "
                        f"(see its output).{memory.explain(f'rank {rank}')} Ending the run.")
                    kill_if_local(self._peers.get(rank), f"rank {rank}")
                    self._fail(RemoteError(rank, "heartbeat", f"rank {rank} stopped answering "
                                           f"heartbeats; {doing}"))
                    # main gets the error from the call it waits on; if it is not waiting on
                    # any, end the run anyway after a grace period
                    threading.Timer(env_float("HFLOW_ABORT_GRACE_S", 5.0), self._abort,
                                    (f"rank {rank} is unreachable",)).start()
                    return

    def doing(self, rank: int) -> str:
        """What `rank` was doing, from the controller's side: the oldest call it has not
        answered (ranks run their calls in issue order), or that it was idle."""
        outstanding = dict(self._outstanding[rank])
        if not outstanding:
            return "it had no call in flight"
        what, since = outstanding[min(outstanding)]
        more = f" (+{len(outstanding) - 1} queued)" if len(outstanding) > 1 else ""
        return f"its last call: {what}, running for {time.monotonic() - since:.0f} s{more}"

    # ---- the end ---------------------------------------------------------------------------
    def _close(self) -> None:
        """Normal end: every rank finishes its queued calls, then everyone leaves RPC."""
        if self._failure is not None:
            raise RuntimeError("a worker call failed earlier in the run (caught by main?); "
                               "ending the run as failed") from self._failure
        stop = {r: Stop() for r in range(self.world_size)}
        self._issue("shutdown", stop, lambda parts: None).result()
        self._closing.set()

    def _abort(self, reason: str, code: int = 1) -> None:
        """Failed end: tell every rank to exit non-zero, then exit non-zero. Never returns
        (a second caller waits here while the first one ends the process)."""
        self._aborting.acquire()
        self._closing.set()
        log(f"hflow: ending the run on all {self.world_size} ranks: {reason}")
        acks = []
        for rank in range(self.world_size):
            if rank != self._server.rank:
                try:
                    acks.append(transport.send(rank, ("abort", reason), timeout_s=5))
                except Exception:
                    pass
        for ack in acks:
            try:
                ack.wait()
            except Exception:
                pass   # that rank is already gone
        hard_exit(code)


def _private_copy(x):
    """What crossing RPC gives a remote worker, for rank 0's own worker: a copy it can modify
    without touching the controller's objects (and the other way round). Tensors are cloned
    by hand: deepcopy of a view (a dp shard) would copy the whole underlying storage."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, Batch):
        return Batch({k: _private_copy(v) for k, v in x.items()}, _private_copy(x.meta))
    if isinstance(x, (Spawn, Call)):
        return dataclasses.replace(x, args=_private_copy(x.args), kwargs=_private_copy(x.kwargs))
    if type(x) in (list, tuple):
        return type(x)(_private_copy(v) for v in x)
    if type(x) is dict:
        return {k: _private_copy(v) for k, v in x.items()}
    return copy.deepcopy(x)
