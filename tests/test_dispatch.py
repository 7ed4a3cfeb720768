"""Dispatch modes, padding, tensor-parallel peers, futures that overlap, and per-rank ordering
under 200 interleaved async calls with collectives. Real processes, 2 and 4 ranks."""
import os

import pytest

from dist import PROGRAMS, run_ranks


SCRIPT = os.path.join(PROGRAMS, "dispatch_modes.py")


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_dispatch_modes_futures_and_ordering(tmp_path, nproc):
    run = run_ranks(SCRIPT, nproc, args=[tmp_path], tmp_path=tmp_path, timeout=300).check()
    assert "ALL OK" in run.outputs[0], run.output


@pytest.mark.dist
def test_bench_dispatch_smoke(tmp_path):
    """The benchmark script runs and reports both figures (tiny sizes; figures not checked)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "bench_dispatch.py")
    run = run_ranks(script, 2, args=["--mib", "2", "--iters", "1", "--calls", "20"],
                    tmp_path=tmp_path, timeout=300).check()
    assert "empty call to a 2-rank group" in run.outputs[0], run.output
    assert "2 MiB Batch split over 2 ranks and gathered back" in run.outputs[0], run.output


# ---- balancing the shards by tokens (pure functions: no processes) ---------------------------

import random

import torch

from hflow.batch import Batch
from hflow.dispatch import RankGrid, balanced_order, gather, scatter


@pytest.mark.parametrize("shards, m", [(2, 1), (2, 7), (3, 5), (4, 16)])
def test_balanced_order_keeps_positions_and_bounds_the_spread(shards, m):
    rng = random.Random(shards * 100 + m)
    lengths = [rng.randint(1, 100) for _ in range(shards * m)]
    order = balanced_order(lengths, shards)
    assert sorted(order) == list(range(shards * m))                    # a permutation
    assert all(row % m == j % m for j, row in enumerate(order))         # a row keeps its position
    loads = [sum(lengths[row] for row in order[r * m:(r + 1) * m]) for r in range(shards)]
    assert max(loads) - min(loads) <= max(lengths)


def test_balanced_order_evens_out_what_a_plain_cut_does_not():
    lengths = [90] * 8 + [10] * 8          # the long rows first: a plain cut gives 720 vs 80 tokens
    order = balanced_order(lengths, 2)
    loads = [sum(lengths[row] for row in order[:8]), sum(lengths[row] for row in order[8:])]
    assert loads == [400, 400]
    with pytest.raises(ValueError, match="equal shards"):
        balanced_order([1, 2, 3], 2)


@pytest.mark.parametrize("rows, per_row", [(12, 1), (11, 1), (11, 3)])
def test_a_balanced_call_returns_rows_in_the_callers_order(rows, per_row):
    grid = RankGrid.of([0, 1, 2, 3], (2, 2), ("dp", "tp"))
    lengths = torch.tensor([(7 * i) % 13 + 1 for i in range(rows)])
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
    batch = Batch({"attention_mask": mask, "row": torch.arange(rows)})
    calls, context = scatter("dp", grid, (batch,), {}, balance=True)
    assert context.order is not None
    shard_tokens = {c.rank: int(c.args[0]["attention_mask"].sum()) for c in calls}
    assert abs(shard_tokens[0] - shard_tokens[2]) <= int(lengths.max())   # ranks 0 and 2: dp 0 and 1
    assert shard_tokens[0] == shard_tokens[1]                              # tp peers: the same shard
    # each rank returns per_row rows per input row, tagged with the row they came from
    results = {c.rank: Batch({"row": c.args[0]["row"].repeat_interleave(per_row),
                              "k": torch.arange(per_row).repeat(len(c.args[0]))}) for c in calls}
    out = gather("dp", grid, context, results)
    assert out["row"].tolist() == torch.arange(rows).repeat_interleave(per_row).tolist()
    assert out["k"].tolist() == torch.arange(per_row).repeat(rows).tolist()
