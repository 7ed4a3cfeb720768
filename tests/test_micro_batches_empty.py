"""A rank with fewer prompt groups (or rows) than the micro-batch count agreed over the ranks.

The count is the maximum over the data-parallel ranks (every rank runs as many forward/backward
passes: FSDP's collectives must match), so a rank with little data used to get an empty
micro-batch, and the actor's forward of it failed in transformers' mask preparation
(IndexError: index -1 is out of bounds for dimension 1 with size 0). Now the split cuts groups
before it leaves a micro-batch empty, and where a rank has fewer rows than micro-batches the
empty ones run a stand-in pass weighted 0: the gradient and the log-probs do not change.
"""
import pytest
import torch
from dist import torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir

from hflow.layout import sequence_tensors
from hflow.workers.micro_batches import budget_groups, micro_batch_count, packed_tokens, split_micro_batches


def covers(parts, n):
    return sorted(torch.cat(parts).tolist()) == list(range(n))


def test_fewer_groups_than_micro_batches_cuts_a_group_instead_of_leaving_one_empty():
    """The report's case: 8 rows of 300 tokens in 2 groups, 3 micro-batches (the count of another
    rank). It used to return [0..3], [4..7] and an empty third micro-batch."""
    groups = torch.tensor([0] * 4 + [1] * 4)
    parts = split_micro_batches(torch.tensor([300] * 8), 3, balance=True, groups=groups)
    assert len(parts) == 3 and all(len(p) for p in parts), parts
    assert covers(parts, 8)
    for p in parts:   # a part is a run of one group, in row order
        assert len(set(groups[p].tolist())) == 1 and p.tolist() == sorted(p.tolist())
    assert sorted(len(p) for p in parts) == [2, 2, 4]


def test_a_cut_group_stays_within_the_token_budget():
    """Realistic rows: a 300-token prompt, 4 samples of 20-60 tokens, a 1024-token budget, and a
    count of 4 agreed with a busier rank: every micro-batch non-empty and, packed (its prompt
    once in each part), within the budget."""
    t = sequence_tensors([[5] * 300] * 4 + [[6] * 280] * 4, [[9] * r for r in (20, 60, 40, 30, 50, 10, 25, 35)],
                         pad_id=0)
    groups = budget_groups(t, 1024)
    tokens = packed_tokens(t, groups)
    assert micro_batch_count(tokens, 0, 1024, row_tokens=t["attention_mask"].sum(-1)) == 1   # this rank's own
    parts = split_micro_batches(tokens, 4, balance=True, groups=groups)
    assert all(len(p) for p in parts) and covers(parts, 8)
    for p in parts:
        packed = packed_tokens({k: v[p] for k, v in t.items()})   # the prompt counted once in the part
        assert int(packed.sum()) <= 1024


def test_only_fewer_rows_than_micro_batches_leave_one_empty():
    parts = split_micro_batches(torch.tensor([7, 3]), 3, balance=True, groups=torch.tensor([0, 0]))
    assert [len(p) for p in parts].count(0) == 1 and covers([p for p in parts if len(p)], 2)
    parts = split_micro_batches(torch.tensor([7, 3]), 3, balance=False)
    assert [len(p) for p in parts].count(0) == 1 and covers(parts, 2)
    # rows of 0 tokens (empty responses sharing a prompt) still go to an empty micro-batch first
    parts = split_micro_batches(torch.tensor([5, 0, 0]), 3, balance=True)
    assert all(len(p) for p in parts)
    # enough groups: whole groups, as before
    parts = split_micro_batches(torch.tensor([5, 5, 5, 5]), 2, balance=True, groups=torch.tensor([0, 0, 1, 1]))
    assert sorted(p.tolist() for p in parts) == [[0, 1], [2, 3]]


PROGRAM = """
import functools, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow import algos
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig
from hflow.workers import micro_batches
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path, out, shard_size = sys.argv[1], sys.argv[2], int(sys.argv[3])

def loss_fn(logp, mb, entropy=None, *, agg):
    return algos.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], agg=agg)

batch = random_rollouts(4, 2, 101, seed=30)   # 8 rows, 4 prompts of 2 samples
del batch["old_log_probs"]                    # on-policy: every response token has a gradient
# 2 ranks, unevenly: rank 0 one prompt (2 rows), rank 1 three (6 rows)
rows = slice(0, 8) if world == 1 else (slice(0, 2) if rank == 0 else slice(2, 8))
local = {k: v[rows] for k, v in batch.items()}
actor = Actor(mesh, ActorConfig(model_path=path, optim=OptimConfig(lr=0.0, grad_clip=0.0),
                                fsdp=FSDPConfig(shard_size=shard_size)))
names = {p: n for n, p in actor.model.named_parameters()}
grads = []
actor.optimizer.register_step_pre_hook(
    lambda optimizer, args, kwargs: grads.append({names[p]: p.grad.full_tensor() for p in names if p.grad is not None}))
empties = {}
split = actor.micro_batches
def counted(tensors):
    parts = split(tensors)
    empties[key] = [len(p) for p in parts].count(0)
    return parts
actor.micro_batches = counted
saved = {}
for budget in (0, 10**6):          # micro-batches by row count, or by tokens (groups kept together)
    for count in (1, 2, 3, 8, 9):  # forced: this rank's own count is 1, another rank's may be more
        micro_batches.micro_batch_count = lambda *args, count=count, **kwargs: count
        actor.cfg.max_tokens_per_micro_batch = budget
        for agg in algos.AGG_MODES:
            key = (budget, count, agg)
            actor.update(local, functools.partial(loss_fn, agg=agg), loss_agg=agg)
            saved[key] = grads.pop()
        key = (budget, count, "log_probs")
        saved[key] = actor.log_probs(local)["old_log_probs"]
gathered = [None] * world
dist.all_gather_object(gathered, (empties, {k: v for k, v in saved.items() if k[2] == "log_probs"}))
if rank == 0:
    saved["empties"] = [g[0] for g in gathered]
    for k in saved:
        if k != "empties" and k[2] == "log_probs":
            saved[k] = torch.cat([g[1][k] for g in gathered])
    torch.save(saved, out)
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.dist
def test_a_rank_with_fewer_groups_than_micro_batches_trains_as_without_them(tmp_path):
    """One update with the micro-batch count forced to 1, 2, 3, 8, 9, by rows and by tokens, for
    each aggregation, on 1 rank (all 8 rows) and on 2 ranks given 2 and 6 rows (parameters
    sharded over both, and replicated): the gradient and the log-probs equal those of one
    micro-batch on 1 rank. Rank 0's 2 rows in 3 or more micro-batches leave empty ones, whose
    stand-in passes keep the collectives matched and add exactly nothing (1 rank, by rows: 9
    micro-batches, the last empty, give the bits of 8). Before the fix the first empty
    micro-batch raised IndexError in the forward."""
    from hflow import algos

    path = tiny_model_dir(tmp_path / "model")
    runs = {}
    for name, world, shard_size in (("one", 1, 1), ("sharded", 2, 2), ("replicated", 2, 1)):
        torchrun(PROGRAM, nproc=world, args=[path, tmp_path / f"{name}.pt", shard_size], tmp_path=tmp_path,
                 timeout=300, env=TESTS_ENV).check()
        runs[name] = torch.load(tmp_path / f"{name}.pt")
    one = runs["one"]
    # where micro-batches were empty: only where a rank had fewer rows than the count
    assert one["empties"][0] == {(b, c, k): int(c == 9) for b in (0, 10**6) for c in (1, 2, 3, 8, 9)
                                 for k in (*algos.AGG_MODES, "log_probs")}
    for name in ("sharded", "replicated"):
        rank0, rank1 = runs[name]["empties"]
        assert all(v == max(0, key[1] - 2) for key, v in rank0.items()), rank0   # 2 rows: count - 2 empty
        assert all(v == max(0, key[1] - 6) for key, v in rank1.items()), rank1
    for budget in (0, 10**6):
        for agg in algos.AGG_MODES:
            reference = one[0, 1, agg]
            for name, run in runs.items():
                for count in (1, 2, 3, 8, 9):
                    grads = run[budget, count, agg]
                    assert grads.keys() == reference.keys()
                    for p, grad in grads.items():
                        where = f"{name}, budget {budget}, {count} micro-batches, {agg}, {p}"
                        torch.testing.assert_close(grad, reference[p], rtol=1e-5, atol=1e-6,
                                                   msg=lambda m, where=where: f"{where}: {m}")
            # the stand-in pass adds exact zeros: 8 single rows, then an empty micro-batch, in the same order
            for p, grad in one[0, 9, agg].items():
                assert torch.equal(grad, one[0, 8, agg][p]), (agg, p)
        for name, run in runs.items():
            for count in (1, 2, 3, 8, 9):
                torch.testing.assert_close(run[budget, count, "log_probs"], one[0, 1, "log_probs"],
                                           rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}, {budget}, {count}: {m}")
