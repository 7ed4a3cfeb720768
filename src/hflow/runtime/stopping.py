"""Stopping a run on Ctrl-C or SIGTERM without losing it.

On rank 0 the first SIGINT or SIGTERM only asks the run to stop: the step in progress finishes,
is checkpointed (also with `--trainer.save-every 0`), and the run ends with one message saying
where it stopped and how to continue, with exit status 128 + the signal's number (130, 143),
as a shell reports a process killed by it. A second Ctrl-C stops at once.

The other ranks ignore both signals while the controller lives: torchrun sends the terminal's
Ctrl-C (and a scheduler's SIGTERM) to every rank, and a worker that died on it would take the
step being saved with it. They leave when the controller closes the run, or when its heartbeat
stops (server.py), or when torchrun kills them `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (30) seconds
after it forwarded the signal: a step and its checkpoint must fit in that time; raise it for
large models.
"""
from __future__ import annotations

import signal
import sys
import time

from hflow.validation import UserError

# torchrun forwards the terminal's Ctrl-C to the ranks that the terminal already signalled, and
# follows it with its own SIGTERM on shutdown: signals this close to the first are the same request.
SAME_REQUEST_S = 2.0
_requested: tuple[int, float] | None = None   # (signal number, time.monotonic()) of the first


class RunInterrupted(UserError):
    """The run stopped on a signal, after saving what it could; `exit_code` is 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def install() -> None:
    """Rank 0 (the main thread): SIGINT and SIGTERM ask the run to stop after the step in progress."""
    global _requested
    _requested = None
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)


def ignore() -> None:
    """The serving ranks: neither signal ends them; the controller does."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def request(signum: int) -> None:
    """Ask the run to stop as a signal would (for callers that catch the signal themselves)."""
    _on_signal(signum, None)


def requested() -> int | None:
    """The number of the signal that asked the run to stop, or None."""
    return None if _requested is None else _requested[0]


def stop_if_asked(what: str) -> None:
    """For loops with no checkpoint of their own: end the run with `hflow: stopped by SIG... <what>`
    once a signal asked for it (call where what the loop did so far is safe to leave)."""
    if (signum := requested()) is not None:
        raise RunInterrupted(f"hflow: stopped by {signal_name(signum)} {what}", signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _on_signal(signum: int, frame) -> None:
    global _requested
    now = time.monotonic()
    if _requested is None:
        _requested = (signum, now)
        again = "press Ctrl-C again to stop at once" if signum == signal.SIGINT else "SIGINT stops at once"
        print(f"\nhflow: {signal_name(signum)}: stopping after the step in progress, which is saved "
              f"({again})", file=sys.stderr, flush=True)
        return
    if signum == signal.SIGINT and now - _requested[1] > SAME_REQUEST_S:
        raise KeyboardInterrupt
