"""Batch scoring: one score function over many responses, never crashing, never hanging.

``score_batch`` runs the function in worker processes, one response at a time per worker, each
under a deadline. A response whose scoring raises, takes longer than ``timeout`` seconds (its
worker is killed and replaced) or kills its worker scores 0, and the batch metrics count it as
an error, a timeout or a crash. Functions marked ``inline_safe`` (the fast built-ins) run in the
calling process instead: starting processes would cost more than scoring.

Workers are started with ``forkserver`` (``spawn`` where unavailable), never ``fork``: the
controller holds RPC and torch threads, and forking a threaded process can deadlock the child.
A function is sent to the workers by reference, so it must be importable: defined at module
level, in an importable module or in the recipe script itself. A fresh worker first loads it
(imports its module) under ``load_timeout``, so that a slow import (torch, sympy) does not count
against the first item's ``timeout``. Workers are daemon processes: a score function may start
subprocesses (``subprocess.run`` for a code sandbox) but not ``multiprocessing`` children.
"""
import atexit
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger("hflow.rewards")

FLOAT32_MAX = 3.4028234663852886e38   # the largest finite float32


@dataclass
class ScoredBatch:
    scores: list[float]
    """One score per response; 0.0 where scoring failed."""
    details: list[dict] = field(default_factory=list)
    """Per response, the extra metrics a dict-returning function gave ({} for a float)."""
    failures: list[Optional[str]] = field(default_factory=list)
    """Per response, None or why it scored 0 ('timeout after 10s', 'ValueError: ...')."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/mean, reward/errors, reward/timeouts, reward/crashes, reward/<extra metric> means."""


# ---------------------------------------------------------------- one item, in any process

def _as_score(out: Any) -> tuple[float, dict]:
    """A score function's return value as (score, extra metrics); ValueError unless the score is
    a real number (a bool counts; a string such as "1.0" does not) that is finite in float32,
    the dtype rewards train in (1e300 would become inf there and the losses NaN)."""
    details = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"score function returned a dict without 'score' (keys: {sorted(out)})")
        details = {k: (v if isinstance(v, (bool, int, float, str)) else repr(v))
                   for k, v in out.items() if k != "score"}
        out = out["score"]
    if not isinstance(out, numbers.Real):
        raise ValueError(f"score function returned {type(out).__name__} {str(out)[:40]!r}, not a number "
                         f"(return a float, or a dict with a float 'score')")
    score = float(out)
    if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
        raise ValueError(f"score function returned {score:g}, which is not a finite float32 "
                         f"(|score| <= {FLOAT32_MAX:.4g})")
    return score, details


def _score_one(fn: Callable, response: str, ground_truth: Any, extra: dict) -> tuple:
    """("ok", score, details) or ("error", reason); catches everything a scorer may raise."""
    try:
        return ("ok", *_as_score(fn(response, ground_truth, **extra)))
    except Exception as e:  # a user's scorer may raise anything: it must cost one score, not the run
        return ("error", f"{type(e).__name__}: {e}"[:500])


def _worker_main(conn) -> None:
    """Serve ("load", pickled fn) and ("score", response, ground truth, extra) until told to stop."""
    # Ctrl-C and SIGTERM are the controller's to handle (it finishes the step: runtime/stopping.py);
    # the worker ends when the pool closes its pipe, also when the controller is killed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fn = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the pool closed the pipe
        if message is None:
            return  # the pool's stop message
        if message[0] == "load":
            try:
                fn = pickle.loads(message[1])
                result = ("loaded",)
            except Exception as e:  # e.g. the scorer's module does not import in a fresh process
                result = ("error", f"cannot load the score function in a worker: {type(e).__name__}: {e}"[:500])
        else:
            result = _score_one(fn, *message[1:])
        try:
            conn.send(result)
        except Exception as e:  # details that do not pickle
            conn.send(("error", f"cannot return the result: {type(e).__name__}: {e}"[:500]))


# ---------------------------------------------------------------- the pool

class _Worker:
    def __init__(self, ctx):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True,
                                   name="hflow-reward-worker")
        self.process.start()
        child_conn.close()
        self.loaded: Optional[bytes] = None  # the pickled score function this worker holds

    def kill(self):
        self.process.kill()
        # SIGKILL always ends it; on a loaded machine reaping can take seconds, and a worker not
        # yet reaped would outlive the pool
        self.process.join(timeout=30)
        self.conn.close()

    def stop(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=1)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


_LOAD = -1  # the job of a worker that is loading the score function, not scoring an item


def default_workers() -> int:
    """One worker per CPU core this process may use, at most 4: more than the cores only queue."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class RewardPool:
    """Worker processes that score responses with a per-item timeout; reused across batches.
    Close it (or use ``with``) to stop the workers; they are daemons, so they die with the
    controller anyway."""

    def __init__(self, num_workers: int = 4, start_method: Optional[str] = None,
                 load_timeout: float = 120.0):
        if num_workers < 0:
            raise ValueError(f"--reward.num-workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers or default_workers()
        self.load_timeout = load_timeout  # importing a scorer's module (torch, sympy) is slow, once
        self._ctx = mp.get_context(start_method or _default_start_method())
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()  # one batch at a time: workers hold per-batch state

    def score(self, fn: Callable, responses: Sequence[str], ground_truths: Sequence,
              extras: Optional[Sequence[dict]] = None, timeout: float = 10.0) -> ScoredBatch:
        """Score every response; each may take ``timeout`` seconds once its worker has loaded
        ``fn`` (loading, i.e. importing its module in a fresh worker, has ``load_timeout``)."""
        responses, ground_truths, extras = _check_inputs(responses, ground_truths, extras)
        try:
            fn_bytes = pickle.dumps(fn)
        except Exception as e:
            raise TypeError(
                f"the score function {fn!r} cannot be sent to worker processes ({e}): define it "
                "at module level of an importable module or of the recipe script"
            ) from e
        results: list = [None] * len(responses)
        with self._lock:
            self._run(fn_bytes, responses, ground_truths, extras, timeout, results)
        return _collect(results)

    def _run(self, fn_bytes, responses, ground_truths, extras, timeout, results):
        todo = deque(range(len(responses)))
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (item or _LOAD, deadline)

        def give_up(reply: tuple):  # the function cannot be loaded in a worker: nor can any item be scored
            while todo:
                results[todo.popleft()] = reply

        try:
            while todo or busy:
                while todo and len(busy) < self.num_workers:
                    worker = self._idle.pop() if self._idle else _Worker(self._ctx)
                    if worker.loaded == fn_bytes:
                        index = todo.popleft()
                        message = ("score", responses[index], ground_truths[index], extras[index])
                        job = (index, time.monotonic() + timeout)
                    else:
                        message, job = ("load", fn_bytes), (_LOAD, time.monotonic() + self.load_timeout)
                    try:
                        worker.conn.send(message)
                    except OSError:  # the worker died while idle: replace it, retry the item
                        worker.kill()
                        if job[0] != _LOAD:
                            todo.appendleft(job[0])
                        continue
                    except Exception as e:  # an item that does not pickle
                        self._idle.append(worker)
                        results[job[0]] = ("error", f"cannot send the item to a worker: {type(e).__name__}: {e}")
                        continue
                    busy[worker] = job
                if not busy:
                    continue
                wait_for = min(deadline for _, deadline in busy.values()) - time.monotonic()
                handles = [w.conn for w in busy] + [w.process.sentinel for w in busy]
                mp.connection.wait(handles, timeout=max(0.0, wait_for))
                for worker, (index, deadline) in list(busy.items()):
                    if worker.conn.poll():
                        try:
                            reply = worker.conn.recv()
                        except (EOFError, OSError):  # died before answering
                            worker.process.join(timeout=5)
                            reply = ("crash", f"worker died (exit code {worker.process.exitcode})")
                            worker.kill()
                        else:
                            self._idle.append(worker)
                    elif not worker.process.is_alive():
                        reply = ("crash", f"worker died (exit code {worker.process.exitcode})")
                        worker.kill()
                    elif time.monotonic() >= deadline:
                        limit = self.load_timeout if index == _LOAD else timeout
                        reply = ("timeout", f"timeout after {limit:g}s" + (" loading the score function" if index == _LOAD else ""))
                        worker.kill()  # the only way to stop a function stuck in C or a loop
                    else:
                        continue
                    del busy[worker]
                    if index != _LOAD:
                        results[index] = reply
                    elif reply[0] == "loaded":
                        worker.loaded = fn_bytes
                    else:
                        give_up(reply)
        finally:
            for worker in busy:  # interrupted (e.g. Ctrl-C): their results would arrive late
                worker.kill()

    def start(self, fn: Callable) -> int:
        """Start the workers and load `fn` in each now (a fresh worker imports the function's
        module: seconds, more on a busy machine), so that the first batch scores at full speed.
        Returns how many workers loaded it; one that failed is dropped, and scoring then says why."""
        try:
            fn_bytes = pickle.dumps(fn)
        except Exception:   # score() raises the error that says what to change
            return 0
        with self._lock:
            starting = [_Worker(self._ctx) for _ in range(self.num_workers - len(self._idle))]
            for worker in starting:
                worker.conn.send(("load", fn_bytes))
            deadline = time.monotonic() + self.load_timeout
            for worker in starting:
                try:
                    loaded = worker.conn.poll(max(0.0, deadline - time.monotonic())) and \
                        worker.conn.recv()[0] == "loaded"
                except (EOFError, OSError):
                    loaded = False
                if loaded:
                    worker.loaded = fn_bytes
                    self._idle.append(worker)
                else:
                    worker.kill()
            return sum(w.loaded == fn_bytes for w in self._idle)

    def close(self):
        with self._lock:
            for worker in self._idle:
                worker.stop()
            self._idle.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- batch scoring

def _check_inputs(responses, ground_truths, extras):
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    if extras is None:
        extras = [{}] * len(responses)
    elif len(extras) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(extras)} extras")
    return list(responses), list(ground_truths), [dict(e or {}) for e in extras]


def _collect(results: list) -> ScoredBatch:
    scores, details, failures, kinds = [], [], [], Counter()
    for result in results:
        if result[0] == "ok":
            scores.append(result[1])
            details.append(result[2])
            failures.append(None)
        else:
            scores.append(0.0)
            details.append({})
            failures.append(result[1])
            kinds[result[0]] += 1
    metrics = {"reward/mean": sum(scores) / len(scores) if scores else 0.0,
               "reward/errors": float(kinds["error"]), "reward/timeouts": float(kinds["timeout"]),
               "reward/crashes": float(kinds["crash"])}
    sums, counts = Counter(), Counter()
    for d in details:
        for key, value in d.items():
            if isinstance(value, (bool, int, float)):
                sums[key] += float(value)
                counts[key] += 1
    metrics.update({f"reward/{key}": sums[key] / counts[key] for key in sums})
    failed = [f for f in failures if f is not None]
    if failed:
        logger.warning("%d of %d responses scored 0 because scoring failed (%s); first: %s",
                       len(failed), len(results),
                       ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())), failed[0])
    return ScoredBatch(scores, details, failures, metrics)


_shared_pools: dict[tuple, RewardPool] = {}
_shared_lock = threading.Lock()


def _shared_pool(num_workers: int) -> RewardPool:
    """One pool per worker count and process, reused by every score_batch call."""
    key = (num_workers, os.getpid())
    with _shared_lock:
        if key not in _shared_pools:
            _shared_pools[key] = RewardPool(num_workers)
        return _shared_pools[key]


@atexit.register
def _close_shared_pools():
    for pool in _shared_pools.values():
        pool.close()


def score_batch(fn: Callable, responses: Sequence[str], ground_truths: Sequence,
                extras: Optional[Sequence[dict]] = None, num_workers: int = 4,
                timeout: float = 10.0, inline: Optional[bool] = None,
                pool: Optional[RewardPool] = None) -> ScoredBatch:
    """Score ``fn(responses[i], ground_truths[i], **extras[i])`` for every i.

    ``inline=None`` scores in this process when ``fn`` is marked ``inline_safe`` and in worker
    processes (``pool``, or one shared pool per ``num_workers``) otherwise; ``inline=True``
    always scores here, without the timeout. Failures score 0 and are counted in ``.metrics``.
    """
    if inline is None:
        inline = getattr(fn, "inline_safe", False)
    if inline:
        responses, ground_truths, extras = _check_inputs(responses, ground_truths, extras)
        return _collect([_score_one(fn, r, g, e) for r, g, e in zip(responses, ground_truths, extras)])
    return (pool or _shared_pool(num_workers)).score(fn, responses, ground_truths, extras, timeout)
