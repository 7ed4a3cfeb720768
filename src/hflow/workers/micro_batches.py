"""Micro-batches and mini-batches of one rank's rows: how a training pass cuts its share.

A row's cost is the tokens a packed pass computes for it (packing.py): its real tokens, less its
prompt when an earlier row of the micro-batch carries the same prompt. Rows sharing a prompt go
into one micro-batch, so that the prompt is computed once.
"""
from __future__ import annotations

import math

import torch


def _max(x: torch.Tensor) -> int:
    return int(x.max()) if x.numel() else 0


def minibatch_rows(num_rows: int, num_minibatches: int) -> list[torch.Tensor]:
    """Rows of each mini-batch: row i goes to mini-batch i % M (strided).

    Strided, not contiguous, so that a mini-batch is the same set of sequences whatever the
    data-parallel size: rank r holds global rows [r*b, (r+1)*b) and, when b divides by M, its
    local row i is in mini-batch i % M exactly when global row r*b + i is.
    """
    return [torch.arange(k, num_rows, num_minibatches) for k in range(num_minibatches)]


def prompt_groups(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] a group id per row: rows with the same real prompt tokens share one (without a
    response_mask there is no prompt to tell apart: every row is a group of its own)."""
    mask = tensors["attention_mask"].bool()
    if "response_mask" not in tensors or "input_ids" not in tensors:
        return torch.arange(len(mask), device=mask.device)
    R = tensors["response_mask"].shape[1]
    P = mask.shape[1] - R
    prompts = torch.where(mask[:, :P], tensors["input_ids"][:, :P], -1)  # left padding -> -1
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def packed_tokens(tensors: dict[str, torch.Tensor], groups: torch.Tensor | None = None) -> torch.Tensor:
    """[B] the tokens a packed training pass computes for each row (workers/packing.py): its
    real tokens, less its prompt unless it is the first row with that prompt (a shared
    prompt is computed once)."""
    mask = tensors["attention_mask"]
    tokens = mask.sum(-1)
    if len(tokens) < 2 or "response_mask" not in tensors or "input_ids" not in tensors:
        return tokens
    groups = prompt_groups(tensors) if groups is None else groups
    rows = torch.arange(len(groups), device=groups.device)
    first = torch.full_like(groups, len(groups)).scatter_reduce(0, groups, rows, "amin")
    R = tensors["response_mask"].shape[1]
    repeated = first[groups] != rows
    return tokens - repeated * mask[:, :mask.shape[1] - R].sum(-1)


def packed_row_tokens(batch) -> list[int]:
    """The work of each row of a Batch for a training pass, the cost its dispatch balances the
    shards by (`@dispatch("dp", balance=packed_row_tokens)`): packed_tokens, a shared prompt
    counted once."""
    return packed_tokens({k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")
                          if k in batch}).tolist()


def budget_groups(tensors: dict[str, torch.Tensor], max_tokens: int) -> torch.Tensor:
    """prompt_groups, with a group whose packed tokens exceed `max_tokens` (> 0) cut into runs of
    its rows that fit, each run carrying the prompt again: a micro-batch that keeps a group
    together then stays within the budget however many samples share a prompt."""
    groups = prompt_groups(tensors)
    if max_tokens <= 0 or "response_mask" not in tensors:
        return groups
    mask = tensors["attention_mask"]
    full = mask.sum(-1).tolist()
    prompt = mask[:, :mask.shape[1] - tensors["response_mask"].shape[1]].sum(-1).tolist()
    runs: dict[int, tuple[int, int]] = {}   # group -> (its current run's id, that run's tokens)
    cut, next_run = [], 0
    for i, g in enumerate(groups.tolist()):
        run, load = runs.get(g, (-1, 0))
        cost = full[i] - prompt[i] if run >= 0 else full[i]   # the run's first row carries the prompt
        if run < 0 or load + cost > max_tokens:
            run, load, cost, next_run = next_run, 0, full[i], next_run + 1
        runs[g] = (run, load + cost)
        cut.append(run)
    return torch.tensor(cut, device=groups.device)


def micro_batch_count(tokens: torch.Tensor, max_size: int, max_tokens: int,
                      row_tokens: torch.Tensor | None = None) -> int:
    """How many micro-batches this rank needs: rows by count, or by a token budget (`tokens`:
    what each row adds to a micro-batch, packed_tokens; `row_tokens`: each row's own length,
    which must fit the budget, default `tokens`)."""
    if max_tokens > 0:
        longest = tokens if row_tokens is None else row_tokens
        if _max(longest) > max_tokens:
            raise ValueError(f"a sequence of {int(longest.max())} tokens exceeds the micro-batch "
                             f"token budget {max_tokens}: raise --*.max-tokens-per-micro-batch")
        return max(1, math.ceil(int(tokens.sum()) / max_tokens))
    return max(1, math.ceil(len(tokens) / max_size))


def split_micro_batches(tokens: torch.Tensor, count: int, balance: bool,
                        groups: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Split the rows of one rank into `count` micro-batches (every rank must use the same count:
    FSDP runs collectives in each forward). By count: consecutive chunks. By tokens (`balance`):
    the heaviest first into the lightest micro-batch, each kept in row order; with `groups`
    (prompt_groups), the rows of a group go together, so that their prompt is packed once.

    The count is the maximum over the ranks, so a rank may have fewer groups than micro-batches:
    the heaviest group is then cut in two (its prompt packed once in each part) until there are
    as many parts as micro-batches. A micro-batch is empty only when the rank has fewer rows than
    `count` (ModelWorker.train and forward_rows then run a stand-in pass that adds nothing)."""
    n = len(tokens)
    if not balance:
        return [idx for idx in torch.arange(n).tensor_split(count)]
    units: dict[int, list[int]] = {}
    for i, g in enumerate(range(n) if groups is None else groups.tolist()):
        units.setdefault(g, []).append(i)
    per_row = tokens.tolist()
    parts = list(units.values())
    while len(parts) < count:
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda p: sum(per_row[i] for i in p))
        parts.remove(heaviest)
        parts += _halves(heaviest, per_row)
    weighed = sorted(((sum(per_row[i] for i in rows), rows) for rows in parts), key=lambda u: -u[0])
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for weight, rows in weighed:
        # the lightest micro-batch, an empty one first when loads tie (a unit of 0 tokens)
        k = min(range(count), key=lambda j: (load[j], len(bins[j]) > 0))
        bins[k].extend(rows)
        load[k] += weight
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def _halves(rows: list[int], per_row: list[int]) -> list[list[int]]:
    """`rows` (2 or more) cut into two runs, in order, of weights as close to half as can be."""
    total, prefix, best, cut = sum(per_row[i] for i in rows), 0, None, 1
    for k in range(1, len(rows)):
        prefix += per_row[rows[k - 1]]
        gap = abs(2 * prefix - total)
        if best is None or gap < best:
            best, cut = gap, k
    return [rows[:cut], rows[cut:]]
