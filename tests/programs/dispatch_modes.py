"""Dispatch modes, padding, tp peers, futures, call order; run by test_dispatch.py::test_dispatch_modes_futures_and_ordering."""
import os, sys, time
import torch, torch.distributed as dist
import hflow
from hflow import Batch
from hflow.runtime.dispatch import dispatch

LOG = []     # (group tag, call index) in the order this rank ran them, across groups


class Worker:
    def __init__(self, mesh, tag):
        self.mesh, self.tag, self.seen, self.ones = mesh, tag, None, 0

    @dispatch("all")
    def echo(self, value):
        return (dist.get_rank(), value)

    @dispatch("dp")
    def double(self, batch, scale=1):
        self.seen = (batch["x"].tolist(), batch["text"])
        return Batch({"y": batch["x"] * 2 * scale,
                      "by": torch.full((len(batch),), dist.get_rank()),
                      "text": [t.upper() for t in batch["text"]]})

    @dispatch("dp")
    def samples(self, batch, k):
        out = batch.repeat(k)                     # k rows per input row, grouped by row
        return Batch({"x": out["x"], "j": torch.arange(k).repeat(len(batch))})

    @dispatch("dp")
    def shard_sum(self, batch):
        return batch["x"].sum().item()

    @dispatch("dp")
    def mutate(self, batch):
        batch["x"].add_(1000)                     # must not reach the controller's tensor
        return batch

    @dispatch("all")
    def what_i_saw(self):
        return self.seen

    @dispatch("one")
    def only_first(self):
        self.ones += 1
        return dist.get_rank()

    @dispatch("all")
    def count_ones(self):
        return self.ones

    @dispatch("all")
    def reduce(self, i):
        t = torch.tensor([float(i + dist.get_rank())])
        dist.all_reduce(t, group=self.mesh.get_group("dp"))
        LOG.append((self.tag, i))
        return t.item()

    @dispatch("all")
    def log(self):
        return list(LOG)

    @dispatch("all")
    def wait_for(self, path):
        deadline = time.time() + 60
        while not os.path.exists(path):
            assert time.time() < deadline, "the other group never ran: calls did not overlap"
            time.sleep(0.01)
        return True

    @dispatch("one")
    def touch(self, path):
        open(path, "w").close()


def main(cluster, tmp):
    n = cluster.world_size
    whole = cluster.spawn(Worker, "whole")
    rest = cluster.spawn(Worker, "rest", ranks=range(1, n))            # shares ranks with whole
    grid = cluster.spawn(Worker, "grid", mesh_shape=(n // 2, 2), mesh_dim_names=("dp", "tp"))

    # all: same args everywhere, one result per rank in group order
    assert whole.echo("hi") == [(r, "hi") for r in range(n)]
    assert rest.echo(value=3) == [(r, 3) for r in range(1, n)]

    # dp, even: shard i of m rows goes to dp rank i; objects and kwargs travel too
    N = 3 * n
    b = Batch({"x": torch.arange(N), "text": [f"t{i}" for i in range(N)]}, meta={"step": 7})
    out = whole.double(b, scale=5)
    assert out["y"].tolist() == [10 * i for i in range(N)]
    assert out["by"].tolist() == [i // 3 for i in range(N)]
    assert out["text"] == [f"T{i}" for i in range(N)]
    # dp, uneven and tiny: padded with real rows, the padding dropped from the result
    for rows in (N + 1, N - 1, 1):
        odd = b[:rows] if rows <= N else Batch({"x": torch.arange(rows),
                                                "text": ["a"] * rows})
        got = whole.double(odd)
        assert got["y"].tolist() == (odd["x"] * 2).tolist(), (rows, got["y"])
        assert len(got["text"]) == rows
    # k rows per input row, with padding
    for rows in (N, N + 1, 1):
        got = whole.samples(Batch({"x": torch.arange(rows)}), 3)
        assert got["x"].tolist() == torch.arange(rows).repeat_interleave(3).tolist()
        assert got["j"].tolist() == [0, 1, 2] * rows
    # non-Batch results: one per dp shard
    assert whole.shard_sum(Batch({"x": torch.ones(N)})) == [3.0] * n

    # tensor-parallel peers get the same shard; only one answers per dp index
    got = grid.double(b)
    assert got["y"].tolist() == [2 * i for i in range(N)]
    seen = grid.what_i_saw()
    assert [seen[2 * d] == seen[2 * d + 1] for d in range(n // 2)] == [True] * (n // 2)
    assert [len(s[0]) for s in seen] == [N // (n // 2)] * n
    assert set(got["by"].tolist()) == set(range(0, n, 2))   # the first tp peer of each dp

    # one: the group's first rank only
    assert rest.only_first() == 1 and rest.only_first() == 1
    assert rest.count_ones() == [2] + [0] * (n - 2)

    # rank 0's worker works on a copy, as the remote ones do
    mine = Batch({"x": torch.zeros(N)})
    assert whole.mutate(mine)["x"].tolist() == [1000.0] * N
    assert mine["x"].tolist() == [0.0] * N

    # wrong calls fail on the controller, before anything is sent
    for call, message in [(lambda: whole.double(b, scale=Batch({"x": torch.ones(2)})), "lengths"),
                          (lambda: cluster.spawn(Worker, "t", mesh_dim_names=("tp",)).double(b),
                           "mesh dim named 'dp'")]:
        try:
            call()
            raise AssertionError("should have failed")
        except ValueError as e:
            assert message in str(e), e

    # futures: two groups on disjoint ranks run at once (the first waits for the second)
    flag = os.path.join(tmp, "flag")
    left = cluster.spawn(Worker, "left", ranks=range(n // 2))
    right = cluster.spawn(Worker, "right", ranks=range(n // 2, n))
    waiting = left.wait_for.future(flag)
    assert not waiting.done()
    right.touch(flag)
    assert waiting.result(timeout=120) == [True] * (n // 2)

    # ordering: 200 interleaved async calls to two groups sharing ranks, each an all_reduce
    whole.log(); rest.log()
    start = len(whole.log()[0])
    issued, futures = [], []
    for i in range(200):
        group = whole if i % 3 else rest
        issued.append((group, i))
        futures.append(group.reduce.future(i))
    for (group, i), f in zip(issued, futures):
        ranks = group.ranks
        assert f.result(timeout=240) == [float(len(ranks) * i + sum(ranks))] * len(ranks)
    logs = whole.log()
    for r in range(n):
        expected = [("whole" if g is whole else "rest", i)
                    for g, i in issued if r in g.ranks]
        assert logs[r][start:] == expected, f"rank {r} ran calls out of issue order"
    return "ALL OK"


if __name__ == "__main__":
    out = hflow.launch(main, sys.argv[1])
    if out is not None:
        print(out, flush=True)
