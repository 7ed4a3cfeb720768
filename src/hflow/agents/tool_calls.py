"""Tool calls in worker processes, each under a deadline, many trajectories' calls at once.

A call that hangs (in C, in a loop, on a lock) can only be stopped by killing its process, so
tools run in worker processes of their own (forkserver, spawn where unavailable; never fork: the
caller holds RPC and torch threads). ToolRunner lends one worker to one caller (an environment
step, on its own thread) at a time: the calls of different trajectories run side by side in up
to `max_workers` processes, and a slow one holds up nobody else. A call that overruns its
timeout has its worker killed (reaped, not left behind) and replaced; a worker that dies is
replaced too. A fresh worker first loads the tool (imports its module) under `load_timeout`, so
that a tool's first call is not charged for importing torch. Workers are daemon processes: a
tool may start subprocesses (the python tool's sandbox) but not `multiprocessing` children.
Tools marked inline (the calculator) run in the calling thread: a process round trip would cost
more than they do.
"""
from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from hflow.agents.tools import Tool, invoke


@dataclass(frozen=True)
class ToolOutcome:
    status: str
    """ok | bad_input (the model's mistake, told to it) | error (raised, garbage, crash) | timeout."""
    text: str
    """The result, or what went wrong."""


def _worker_main(conn) -> None:
    """Serve ("load", pickled tool) and ("call", pickled tool, arguments as JSON) until told to
    stop; answers ("loaded",), ("unloadable", why) or invoke's (status, text)."""
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
        else:
            reply = invoke(tools[message[1]], json.loads(message[2]))
        conn.send(reply)


def _context():
    return mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


class _Worker:
    """One tool process, started when first needed and started again after it was killed."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.process = None
        self.conn = None
        self.loaded: set[bytes] = set()   # the pickled tools this process holds

    def run(self, fn_bytes: bytes, arguments_json: str, timeout: float, load_timeout: float) -> tuple[str, str]:
        """invoke's (status, text) from the worker, or ("timeout" | "crash" | "unloadable", why)."""
        try:
            for _ in range(2):
                if self.process is None or not self.process.is_alive():
                    self.kill()   # reaps one that died while idle
                    self._start()
                if fn_bytes not in self.loaded:
                    reply = self._ask(("load", fn_bytes), load_timeout, " loading the tool")
                    if reply is None:
                        continue
                    if reply[0] != "loaded":
                        return reply
                    self.loaded.add(fn_bytes)
                reply = self._ask(("call", fn_bytes, arguments_json), timeout, "")
                if reply is not None:
                    return reply
            return "crash", "a fresh tool worker died before taking the call"
        except BaseException:   # interrupted (e.g. Ctrl-C): its answer would come to the next caller
            self.kill()
            raise

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


class ToolRunner:
    """Calls tools from any number of threads, at most `max_workers` of them in processes at once."""

    def __init__(self, max_workers: int = 4, load_timeout: float = 120.0):
        if max_workers < 1:
            raise ValueError(f"a tool runner needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.load_timeout = load_timeout   # importing a tool's module (torch, sympy) is slow, once
        self._ctx = _context()
        self._free: list[_Worker] = []
        self._made = 0
        self._available = threading.Condition()
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
        worker = self._borrow()
        try:
            status, text = worker.run(fn_bytes, arguments_json, timeout_s, self.load_timeout)
        finally:
            self._give_back(worker)
        if status in ("timeout", "crash", "unloadable"):   # the worker's failure, not the tool's answer
            return ToolOutcome("timeout" if status == "timeout" else "error", f"{tool.name}: {text}")
        return ToolOutcome(status, text)

    def _borrow(self) -> _Worker:
        with self._available:
            while True:
                if self._closed:
                    raise RuntimeError("the tool runner is closed")
                if self._free:
                    return self._free.pop()
                if self._made < self.max_workers:
                    self._made += 1
                    return _Worker(self._ctx)
                self._available.wait()

    def _give_back(self, worker: _Worker) -> None:
        with self._available:
            closed = self._closed
            if not closed:
                self._free.append(worker)
            self._available.notify()
        if closed:
            worker.stop()

    def close(self) -> None:
        """Stop the idle workers now (a worker lent out stops when it comes back)."""
        with self._available:
            self._closed = True
            free, self._free = self._free, []
            self._available.notify_all()
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
