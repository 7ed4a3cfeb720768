"""Tool calls in worker processes, each under a deadline, many trajectories' calls at once.

A call that hangs (in C, in a loop, on a lock) can only be stopped by killing its process, so
tools run in worker processes of their own (forkserver, spawn where unavailable; never fork: the
caller holds RPC and torch threads). ToolRunner lends one worker to one caller (an environment
step, on its own thread) at a time: the calls of different trajectories run side by side in up
to `max_workers` processes, and a slow one holds up nobody else. When every worker is busy,
callers queue first come, first served (a worker coming back goes to the longest waiting, never
to a caller that arrives later), so a call waits at most for the calls queued before it.

A call's timeout starts when its worker starts running it: the wait for a worker, and a fresh
worker's start and loading of the tool (imports its module, under `load_timeout`, so that a
first call is not charged for importing torch), count against neither the call's timeout nor
its step's (agents.step_clock). A call that overruns its timeout has its worker killed (reaped,
not left behind) and replaced; a worker that dies is replaced too. Workers are daemon
processes: a tool may start subprocesses (the python tool's sandbox) but not `multiprocessing`
children. Tools marked inline (the calculator) run in the calling thread: a process round trip
would cost more than they do. `score` runs a final answer's score function in the same workers.
"""
from __future__ import annotations

import atexit
import functools
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hflow.agents.step_clock import waiting_for_a_worker
from hflow.agents.tools import Tool, invoke


@dataclass(frozen=True)
class ToolOutcome:
    status: str
    """ok | bad_input (the model's mistake, told to it) | error (raised, garbage, not loadable) |
    timeout | crash (its worker process died)."""
    text: str
    """The result, or what went wrong."""


def _worker_main(conn) -> None:
    """Serve ("load", pickled function), ("call", pickled tool, arguments as JSON) and ("apply",
    pickled function, pickled arguments) until told to stop; answers ("loaded",), ("unloadable",
    why), invoke's (status, text) to a call and ("ok", its value) or ("error", why) to an apply."""
    # Ctrl-C and SIGTERM are the caller's to handle; the worker ends when its pipe is closed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tools: dict[bytes, Callable] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "load":
            try:
                tools[message[1]] = pickle.loads(message[1])
                reply = ("loaded",)
            except Exception as e:  # e.g. the tool's module does not import in a fresh process
                reply = ("unloadable", f"cannot load the tool in a worker: {type(e).__name__}: {e}"[:500])
        elif message[0] == "call":
            reply = invoke(tools[message[1]], json.loads(message[2]))
        else:
            reply = _apply(tools[message[1]], message[2])
        try:
            conn.send(reply)
        except Exception as e:  # a value that does not pickle
            conn.send(("error", f"cannot return the result: {type(e).__name__}: {e}"[:500]))


def _apply(fn: Callable, args_bytes: bytes) -> tuple[str, Any]:
    try:
        return "ok", fn(*pickle.loads(args_bytes))
    except Exception as e:  # the function's own fault
        return "error", f"{type(e).__name__}: {e}"[:500]


def _score_answer(fn: Callable, answer: str, ground_truth, extra: dict) -> tuple[float, Optional[str]]:
    """In a worker: a final answer's (score, why it failed or None), as rewards scores a response."""
    from hflow.rewards import score_batch   # already imported with hflow.agents.tools
    scored = score_batch(fn, [answer], [ground_truth], [extra], inline=True)
    return scored.scores[0], scored.failures[0]


def _context():
    return mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


class _Worker:
    """One tool process, started when first needed and started again after it was killed."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.process = None
        self.conn = None
        self.loaded: set[bytes] = set()   # the pickled tools this process holds

    def run(self, fn_bytes: bytes, message: tuple, timeout: float, load_timeout: float) -> tuple:
        """The worker's answer to `message` (a call or an apply of the function `fn_bytes`), or
        ("timeout" | "crash" | "unloadable", why). The timeout starts once the worker holds the
        function: starting the worker and loading it are waits for a worker (step_clock)."""
        try:
            for _ in range(2):
                with waiting_for_a_worker():
                    ready = self._ready(fn_bytes, load_timeout)
                if ready is None:
                    continue
                if ready[0] != "loaded":
                    return ready
                reply = self._ask(message, timeout, "")
                if reply is not None:
                    return reply
            return "crash", "a fresh tool worker died before taking the call"
        except BaseException:   # interrupted (e.g. Ctrl-C): its answer would come to the next caller
            self.kill()
            raise

    def _ready(self, fn_bytes: bytes, load_timeout: float) -> Optional[tuple]:
        """("loaded",) once the process runs and holds the function, the failure to load it, or
        None when the process died before taking it."""
        if self.process is None or not self.process.is_alive():
            self.kill()   # reaps one that died while idle
            self._start()
        if fn_bytes in self.loaded:
            return ("loaded",)
        reply = self._ask(("load", fn_bytes), load_timeout, " loading the tool")
        if reply is not None and reply[0] == "loaded":
            self.loaded.add(fn_bytes)
        return reply

    def _ask(self, message, timeout: float, doing: str) -> Optional[tuple]:
        """The worker's answer, or the failure; None when it died before taking the message."""
        try:
            self.conn.send(message)
        except OSError:
            self.kill()
            return None
        deadline = time.monotonic() + timeout
        while True:
            ready = mp.connection.wait([self.conn, self.process.sentinel],
                                       timeout=max(0.0, deadline - time.monotonic()))
            if self.conn in ready or self.conn.poll():
                try:
                    return self.conn.recv()
                except (EOFError, OSError):   # died before answering
                    return self._died()
            if not self.process.is_alive():
                return self._died()
            if time.monotonic() >= deadline:
                self.kill()   # the only way to stop a function stuck in C or a loop
                return "timeout", f"timeout after {timeout:g}s{doing}"

    def _start(self):
        self.conn, child_conn = self._ctx.Pipe()
        self.process = self._ctx.Process(target=_worker_main, args=(child_conn,), daemon=True,
                                         name="hflow-tool-worker")
        self.process.start()
        child_conn.close()
        self.loaded = set()

    def _died(self) -> tuple[str, str]:
        self.process.join(timeout=5)
        reply = "crash", f"worker died (exit code {self.process.exitcode})"
        self.kill()
        return reply

    def kill(self):
        if self.process is None:
            return
        self.process.kill()
        # SIGKILL always ends it; on a loaded machine reaping can take seconds, and a worker not
        # yet reaped would outlive the runner
        self.process.join(timeout=30)
        self.conn.close()
        self.process = self.conn = None

    def stop(self):
        if self.process is None:
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=1)
        self.kill()   # reaps it, or kills it if it did not stop


class _Waiting:
    """A caller queued for a worker: the worker is handed to it, and it is woken."""

    def __init__(self):
        self.handed = threading.Event()
        self.worker: Optional[_Worker] = None


class ToolRunner:
    """Calls tools from any number of threads, at most `max_workers` of them in processes at
    once, the others queued first come, first served."""

    def __init__(self, max_workers: int = 4, load_timeout: float = 120.0):
        if max_workers < 1:
            raise ValueError(f"a tool runner needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.load_timeout = load_timeout   # importing a tool's module (torch, sympy) is slow, once
        self._ctx = _context()
        self._lock = threading.Lock()
        self._free: list[_Worker] = []
        self._made = 0
        self._queue: deque[_Waiting] = deque()
        self._closed = False

    def call(self, tool: Tool, arguments: dict, timeout_s: float) -> ToolOutcome:
        if tool.inline:
            return ToolOutcome(*invoke(tool.fn, arguments))
        try:
            arguments_json = json.dumps(arguments)
        except (TypeError, ValueError) as e:
            return ToolOutcome("bad_input", f"the arguments are not JSON: {e}")
        try:
            fn_bytes = pickle.dumps(tool.fn)
        except Exception as e:   # a lambda, a function inside a function
            return ToolOutcome("error", f"the tool {tool.fn!r} cannot be sent to worker processes ({e}): define it "
                                        "at module level of an importable module")
        status, text = self._run(fn_bytes, ("call", fn_bytes, arguments_json), timeout_s)
        if status in ("timeout", "crash", "unloadable"):   # the worker's failure, not the tool's answer
            return ToolOutcome("error" if status == "unloadable" else status, f"{tool.name}: {text}")
        return ToolOutcome(status, text)

    def score(self, fn: Callable, answer: str, ground_truth, extra: dict, timeout_s: float) -> tuple[float, Optional[str]]:
        """A final answer's score by `fn` (an hflow score function) in a worker, and None or why
        it scored 0: it raised, returned garbage, overran `timeout_s` or killed its worker.
        (hflow.rewards' shared pool scores one batch at a time: one trajectory's answer each,
        every trajectory would queue behind one lock.)"""
        try:
            fn_bytes = pickle.dumps(functools.partial(_score_answer, fn))
            args_bytes = pickle.dumps((answer, ground_truth, extra))
        except Exception as e:
            return 0.0, f"the score function or its ground truth cannot be sent to worker processes: {e}"[:500]
        status, value = self._run(fn_bytes, ("apply", fn_bytes, args_bytes), timeout_s)
        return value if status == "ok" else (0.0, f"{status}: {value}")

    def _run(self, fn_bytes: bytes, message: tuple, timeout_s: float) -> tuple:
        with waiting_for_a_worker():
            worker = self._borrow()
        try:
            return worker.run(fn_bytes, message, timeout_s, self.load_timeout)
        finally:
            self._give_back(worker)

    def _borrow(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
            if self._free:   # only while nobody is queued: a worker given back goes to the queue first
                return self._free.pop()
            if self._made < self.max_workers:
                self._made += 1
                return _Worker(self._ctx)
            waiting = _Waiting()
            self._queue.append(waiting)
        try:
            waiting.handed.wait()
        except BaseException:   # interrupted while queued: leave the queue, or pass on a worker just handed over
            with self._lock:
                handed = waiting.worker
                if handed is None:
                    self._queue.remove(waiting)
            if handed is not None:
                self._give_back(handed)
            raise
        if waiting.worker is None:
            raise RuntimeError("the tool runner is closed")
        return waiting.worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            closed = self._closed
            if not closed and self._queue:
                # straight to the longest waiting: a caller arriving now cannot take it first
                waiting = self._queue.popleft()
                waiting.worker = worker
                waiting.handed.set()
                return
            if not closed:
                self._free.append(worker)
        if closed:
            worker.stop()

    def close(self) -> None:
        """Stop the idle workers now (a worker lent out stops when it comes back); callers still
        queued are told the runner is closed."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            queued, self._queue = list(self._queue), deque()
        for waiting in queued:
            waiting.handed.set()
        for worker in free:
            worker.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_shared: dict[int, ToolRunner] = {}
_shared_lock = threading.Lock()


def shared_runner(max_workers: int = 4) -> ToolRunner:
    """One runner per process (the first call sets its size): what environments use by default."""
    with _shared_lock:
        runner = _shared.get(os.getpid())
        if runner is None or runner._closed:
            runner = _shared[os.getpid()] = ToolRunner(max_workers)
        return runner


@atexit.register
def _close_shared():
    for runner in _shared.values():
        runner.close()
