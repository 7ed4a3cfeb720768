"""A rank with fewer prompt groups (or rows) than the micro-batch count agreed over the ranks.

The count is the maximum over the data-parallel ranks (every rank runs as many forward/backward
passes: FSDP's collectives must match), so a rank with little data used to get an empty
micro-batch, and the actor's forward of it failed in transformers' mask preparation
(IndexError: index -1 is out of bounds for dimension 1 with size 0). Now the split cuts groups
before it leaves a micro-batch empty, and where a rank has fewer rows than micro-batches the
empty ones run a stand-in pass weighted 0: the gradient and the log-probs do not change.
"""
import torch

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
