"""Controller overhead: latency of an empty call, bandwidth of a Batch scattered and gathered.

    torchrun --nproc-per-node 4 scripts/bench_dispatch.py               # 256 MiB, as reported
    torchrun --nproc-per-node 4 scripts/bench_dispatch.py --mib 8 --iters 3   # a smoke run

Measures, on a group spanning every rank:
  - round-trip latency of an empty @dispatch("all") call (median of --calls);
  - a --mib MiB float32 Batch sent with @dispatch("dp") (split over the ranks) and returned
    whole (each rank sends its shard back): time per round trip and the controller's
    throughput counting the bytes both ways, 2 * size / time; plus send-only (the workers
    return nothing), size / time.
Rank 0's own shard moves by a memory copy, the others' over RPC, as in a real run.
"""
from dataclasses import dataclass
import statistics
import time

import torch
import tyro

import hflow
from hflow import Batch
from hflow.runtime.dispatch import dispatch


@dataclass
class Config:
    mib: int = 256
    """Size of the Batch in MiB."""
    iters: int = 5
    """Timed round trips of the Batch (after one warm-up)."""
    calls: int = 500
    """Timed empty calls (after 20 warm-up calls)."""


class Echo:
    def __init__(self, mesh):
        pass

    @dispatch("all")
    def noop(self):
        return None

    @dispatch("dp")
    def echo(self, batch: Batch) -> Batch:
        return batch

    @dispatch("dp")
    def sink(self, batch: Batch) -> None:
        return None


def main(cluster: hflow.Cluster, cfg: Config):
    group = cluster.spawn(Echo)
    for _ in range(20):
        group.noop()
    latencies = []
    for _ in range(cfg.calls):
        t = time.perf_counter()
        group.noop()
        latencies.append(time.perf_counter() - t)
    lat = sorted(latencies)

    cols = 1024
    rows = cfg.mib * 2 ** 20 // (4 * cols)
    batch = Batch({"x": torch.randn(rows, cols)})
    size = rows * cols * 4
    out = group.echo(batch)
    assert torch.equal(out["x"], batch["x"]), "the round trip changed the data"
    round_trips, sends = [], []
    for _ in range(cfg.iters):
        t = time.perf_counter()
        group.echo(batch)
        round_trips.append(time.perf_counter() - t)
        t = time.perf_counter()
        group.sink(batch)
        sends.append(time.perf_counter() - t)
    rt, send = statistics.median(round_trips), statistics.median(sends)
    n = cluster.world_size
    print(f"bench_dispatch: {n} ranks, device {cluster.device}")
    print(f"empty call to a {n}-rank group: median {lat[len(lat) // 2] * 1e3:.2f} ms, "
          f"p90 {lat[int(len(lat) * 0.9)] * 1e3:.2f} ms ({cfg.calls} calls)")
    print(f"{size / 2 ** 20:.0f} MiB Batch split over {n} ranks and gathered back: "
          f"{rt * 1e3:.0f} ms, {2 * size / rt / 1e9:.2f} GB/s both ways counted; "
          f"send only: {send * 1e3:.0f} ms, {size / send / 1e9:.2f} GB/s "
          f"(median of {cfg.iters})", flush=True)


if __name__ == "__main__":
    hflow.launch(main, tyro.cli(Config))
