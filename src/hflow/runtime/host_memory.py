"""The host's available memory, watched so that a rank that vanished can be explained.

On a host without a GPU every model, optimizer state and activation lives in host memory, and
when it runs out the kernel's out-of-memory killer ends the largest process with SIGKILL: no
traceback, no message, only torchrun's "exitcode: -9". The ranks that survive see a peer stop
answering. Each rank samples MemAvailable as it waits (about once a second) and keeps the
lowest of a recent window; when a peer goes silent, `likely_out_of_memory` says whether the host
was nearly out just before, and the message names the flags that lower an update's memory.
"""
from __future__ import annotations

import collections
import time

MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"
"""a cgroup v2 container's own limit (memory.max, memory.current) is what its killer acts on"""
NEARLY_OUT = 0.05
"""available below this share of the total counts as nearly out"""


def read_meminfo(path: str = MEMINFO, cgroup: str = CGROUP) -> tuple[int, int] | None:
    """(available, total) in bytes: /proc/meminfo's MemAvailable and MemTotal, or a cgroup v2
    limit's headroom and the limit where one is set and lower; None where neither is readable."""
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available, total = int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            current = int(f.read())
    except (OSError, ValueError):
        return available, total
    if limit != "max" and int(limit) < total:
        return min(available, max(0, int(limit) - current)), int(limit)
    return available, total


class LowWater:
    """The lowest available memory sampled over the last `window_s` seconds."""

    def __init__(self, window_s: float = 60.0, path: str = MEMINFO, cgroup: str = CGROUP):
        self.window_s, self.path, self.cgroup = window_s, path, cgroup
        self.samples: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def sample(self, now: float | None = None) -> None:
        reading = read_meminfo(self.path, self.cgroup)
        if reading is None:
            return
        now = time.monotonic() if now is None else now
        available, self.total = reading
        self.samples.append((now, available))
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()

    def lowest(self) -> int | None:
        return min((a for _, a in self.samples), default=None)

    def likely_out_of_memory(self) -> bool:
        low = self.lowest()
        return low is not None and self.total > 0 and low < NEARLY_OUT * self.total

    def explain(self, who: str) -> str:
        """A sentence for a message about `who` going silent: '' unless the host was nearly out."""
        if not self.likely_out_of_memory():
            return ""
        gib = 2 ** 30
        return (f" The host's available memory fell to {self.lowest() / gib:.1f} GiB of "
                f"{self.total / gib:.1f} in the last {self.window_s:.0f} s: {who} was most likely ended by "
                f"the kernel's out-of-memory killer (torchrun reports exitcode -9, SIGKILL). To need "
                f"less: --actor.fsdp.activation-checkpointing, --actor.fsdp.reshard-after-forward True, "
                f"a smaller --actor.max-tokens-per-micro-batch, fewer ranks on this host (each holds its "
                f"own engine and process), --rollout.tp-size to split the engine (docs/models.md, "
                f"\"Memory\").")
