"""RPC under stress, for the soak test (scripts/soak.py runs it): many calls in flight at once on
groups that share ranks and groups that do not, Batches of random sizes both ways, the heartbeat
at a short interval, rank 0's own executor busy, for --seconds. Every result is checked.

    torchrun --nproc-per-node 2 scripts/soak_rpc.py --seconds 600

Exits 0 with one line of counts when every result was right; a wrong result raises.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro

import hflow
from hflow import Batch
from hflow.runtime.dispatch import dispatch


@dataclass
class Config:
    seconds: float = 60.0
    """How long to keep calls in flight."""
    in_flight: int = 8
    """Calls issued before waiting on the oldest."""
    max_rows: int = 512
    """Largest Batch sent (rows of up to 4096 floats)."""
    seed: int = 0


class Stress:
    """Transforms what it is sent, so that the controller can check every result; some calls run
    a collective over the group too (the pattern of a training pass)."""

    def __init__(self, mesh):
        self.mesh = mesh

    @dispatch("dp")
    def transform(self, batch: Batch, scale: float) -> Batch:
        x = batch["x"]
        return Batch({"y": x * scale + 1.0, "rows": torch.full((len(batch),), float(len(batch))),
                      "tag": [f"{t}!" for t in batch["tag"]]})

    @dispatch("all")
    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value + dist.get_rank()])
        if self.mesh.size() > 1:
            dist.all_reduce(t, group=self.mesh.get_group())
        return t.item()

    @dispatch("one")
    def allocate(self, size: int) -> int:
        # native allocations of many sizes on the executor thread, freed at once
        blocks = [torch.empty(random.randint(1, size)) for _ in range(32)]
        return sum(b.numel() > 0 for b in blocks)


def main(cluster: hflow.Cluster, cfg: Config):
    rng = random.Random(cfg.seed)
    everywhere = cluster.spawn(Stress)
    alone = [cluster.spawn(Stress, ranks=[r]) for r in range(cluster.world_size)]
    pending, counts, start = [], {"transform": 0, "all_reduce": 0, "allocate": 0, "MiB": 0.0}, time.monotonic()

    def check(kind, future, expected):
        result = future.result(timeout=120)
        if kind == "transform":
            x, scale, tags = expected
            assert torch.equal(result["y"], x * scale + 1.0) and result["tag"] == [f"{t}!" for t in tags], kind
        elif kind == "all_reduce":
            assert result == [expected] * len(result), (kind, result, expected)
        else:
            assert result == expected, (kind, result, expected)
        counts[kind] += 1

    while time.monotonic() - start < cfg.seconds:
        kind = rng.choice(["transform", "transform", "all_reduce", "allocate"])
        group = everywhere if rng.random() < 0.5 else rng.choice(alone)
        if kind == "transform":
            rows, width = rng.randint(1, cfg.max_rows), rng.choice([1, 16, 256, 4096])
            x = torch.randn(rows, width)
            tags = [str(rng.random()) for _ in range(rows)]
            scale = rng.random()
            future = group.transform.future(Batch({"x": x, "tag": tags}), scale)
            expected = (x, scale, tags)
            counts["MiB"] += 2 * x.numel() * 4 / 2**20
        elif kind == "all_reduce":
            value = float(rng.randint(0, 100))
            future = group.all_reduce.future(value)
            expected = value * len(group.ranks) + sum(group.ranks)
        else:
            future = group.allocate.future(rng.randint(1, 1 << 20))
            expected = 32
        pending.append((kind, future, expected))
        if len(pending) >= cfg.in_flight:
            check(*pending.pop(0))
    for item in pending:
        check(*item)
    print(f"soak_rpc ok: {counts['transform']} transforms ({counts['MiB']:.0f} MiB), {counts['all_reduce']} "
          f"all-reduces, {counts['allocate']} allocation bursts in {time.monotonic() - start:.0f} s on "
          f"{cluster.world_size} ranks (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    hflow.launch(main, tyro.cli(Config))
