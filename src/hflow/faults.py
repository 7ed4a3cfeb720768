"""A test hook that kills or freezes a rank at a named phase, so that fault tests pick the moment
by what the run is doing, not by a sleep.

    HFLOW_FAULT=update:1:kill        rank 1 SIGKILLs itself when it first reaches an update
    HFLOW_FAULT=generate:1:stop:2    rank 1 SIGSTOPs itself the 2nd time it reaches a generate
    HFLOW_FAULT=update:0:int:3       rank 0 sends itself SIGINT (a Ctrl-C) at its 3rd update

Phases: `generate` (the engine call), `handoff` (the actor's weights into the engine),
`log_probs` (a forward of the actor or reference), `update` (a training step), `checkpoint`
(the controller, after every shard is written and before the directory is renamed into place).
Without HFLOW_FAULT (every real run) `fault_point` returns at once.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

PHASES = ("generate", "handoff", "log_probs", "update", "checkpoint")


@dataclass(frozen=True)
class Fault:
    phase: str
    rank: int
    signal: signal.Signals
    nth: int = 1


def parse(spec: str | None) -> Fault | None:
    if not spec:
        return None
    parts = spec.split(":")
    try:
        phase, rank, action, *nth = parts
        if phase not in PHASES or action not in ACTIONS or len(nth) > 1:
            raise ValueError
        return Fault(phase, int(rank), ACTIONS[action], int(nth[0]) if nth else 1)
    except ValueError:
        raise ValueError(f"HFLOW_FAULT={spec!r}: expected PHASE:RANK:kill|stop|int|term[:NTH] with PHASE one "
                         f"of {', '.join(PHASES)}") from None


ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "int": signal.SIGINT, "term": signal.SIGTERM}

_fault = parse(os.environ.get("HFLOW_FAULT"))
_reached: dict[str, int] = {}


def fault_point(phase: str) -> None:
    if _fault is None or _fault.phase != phase or int(os.environ.get("RANK", 0)) != _fault.rank:
        return
    _reached[phase] = _reached.get(phase, 0) + 1
    if _reached[phase] == _fault.nth:
        print(f"HFLOW_FAULT: rank {_fault.rank} {_fault.signal.name} at {phase} #{_fault.nth} T {time.time()}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), _fault.signal)
