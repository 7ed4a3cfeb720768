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
from hflow.runtime.dispatch import RankGrid, balanced_order, gather, scatter
from hflow.workers.micro_batches import packed_row_tokens


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
    calls, context = scatter("dp", grid, (batch,), {}, balance=packed_row_tokens)
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


def test_balanced_order_moves_the_samples_of_a_prompt_together():
    rng = random.Random(7)
    lengths = [rng.randint(1, 100) for _ in range(32)]
    order = balanced_order(lengths, 2, unit=4)
    assert all(row % 16 == j % 16 for j, row in enumerate(order))
    assert all(order[j] // 4 == order[j - j % 4] // 4 and order[j] % 4 == j % 4 for j in range(32))
    loads = [sum(lengths[row] for row in order[:16]), sum(lengths[row] for row in order[16:])]
    assert abs(loads[0] - loads[1]) <= max(sum(lengths[u:u + 4]) for u in range(0, 32, 4))
    assert balanced_order(lengths[:30], 2, unit=4) == balanced_order(lengths[:30], 2)   # 4 does not divide 15


def test_a_balanced_rollout_keeps_each_prompts_samples_on_one_rank():
    from hflow import layout
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (int(torch.randint(2, 30, (), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(3, 50, (int(torch.randint(1, 40, (), generator=g)),), generator=g).tolist()
                 for _ in range(32)]
    tensors = layout.sequence_tensors([p for p in prompts for _ in range(4)], responses, pad_id=0)
    batch = Batch({**tensors, "prompt": torch.arange(8).repeat_interleave(4)}, meta={"n": 4})
    grid = RankGrid.of([0, 1], (2,), ("dp",))
    calls, context = scatter("dp", grid, (batch,), {}, balance=packed_row_tokens)
    assert context.order != list(range(32))                                  # it did move rows
    for call in calls:
        shard = call.args[0]["prompt"].tolist()
        assert all(shard.count(p) == 4 for p in set(shard))
    # a shared prompt counts once in the work the balancing evens out
    work = [len(p) * (j % 4 == 0) + len(r) for j, (p, r) in
            enumerate(zip([p for p in prompts for _ in range(4)], responses))]
    loads = [sum(work[row] for row in context.order[:16]), sum(work[row] for row in context.order[16:])]
    assert abs(loads[0] - loads[1]) <= max(sum(work[u:u + 4]) for u in range(0, 32, 4))


def test_a_method_declares_the_cost_its_shards_are_balanced_by():
    from hflow.runtime.dispatch import balances, dispatch
    from hflow.workers import Actor, Critic

    assert {balances(m) for m in (Actor.log_probs, Actor.update, Critic.values, Critic.update)} == {packed_row_tokens}
    assert balances(Actor.generate) is None and balances(Actor.save) is None
    with pytest.raises(TypeError, match="each row's work"):
        dispatch("dp", balance=True)
    with pytest.raises(ValueError, match="applies to dispatch mode 'dp'"):
        dispatch("all", balance=packed_row_tokens)
