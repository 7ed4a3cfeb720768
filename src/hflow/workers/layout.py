"""The layout of a batch of sequences — defined here and nowhere else.

A batch of B sequences, each a prompt followed by a response, is a set of tensors:

    input_ids       [B, P + R]  long   the prompt left-padded to P, then the response right-padded to R
    attention_mask  [B, P + R]  long   1 on real tokens (prompt and response), 0 on padding
    responses       [B, R]      long   input_ids[:, P:]
    response_mask   [B, R]      float  1 on response tokens that count in losses, else 0 (padding, and
                                       e.g. tool output inside a multi-turn response)

P is `input_ids.shape[1] - response_mask.shape[1]`. Positions are
`position_ids = max(cumsum(attention_mask) - 1, 0)`, so left padding does not shift them.
Every other per-token tensor (`log_probs`, `old_log_probs`, `ref_log_probs`, `values`,
`advantages`, ...) is [B, R] and aligned with `responses`: column t is about token
`responses[:, t]`, which the model predicts from the logits at sequence position P + t - 1.

Rows come in prompt order with the n samples of a prompt next to each other (row i*n + j is
sample j of prompt i), as `Batch.repeat(n, interleave=True)` lays them out.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hflow.batch import Batch

SEQUENCE_KEYS = ("input_ids", "attention_mask")


def prompt_length(tensors) -> int:
    return tensors["input_ids"].shape[1] - tensors["response_mask"].shape[1]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_tensors(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                     response_len: int | None = None, prompt_len: int | None = None,
                     response_logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, torch.Tensor]:
    """Build the layout above from token lists: `prompts[i]` is the prompt of `responses[i]`.

    `prompt_len` / `response_len` fix the padded widths (so that batches made on different
    ranks concatenate); by default they are the longest prompt / response. Responses longer
    than `response_len` are an error, not silently cut.
    """
    assert len(prompts) == len(responses), (len(prompts), len(responses))
    P = max(map(len, prompts)) if prompt_len is None else prompt_len
    R = max(map(len, responses), default=0) if response_len is None else response_len
    B = len(prompts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.float32)
    logprobs = torch.zeros(B, R, dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        if len(prompt) > P or len(response) > R:
            raise ValueError(f"row {i}: prompt of {len(prompt)} / response of {len(response)} tokens "
                             f"do not fit the widths {P} / {R}")
        input_ids[i, P - len(prompt):P] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[i, P:P + len(response)] = torch.as_tensor(response, dtype=torch.long)
        attention_mask[i, P - len(prompt):P + len(response)] = 1
        response_mask[i, :len(response)] = 1
        if response_logprobs is not None:
            logprobs[i, :len(response)] = torch.as_tensor(response_logprobs[i], dtype=torch.float32)
    out = {"input_ids": input_ids, "attention_mask": attention_mask,
           "responses": input_ids[:, P:].clone(), "response_mask": response_mask}
    if response_logprobs is not None:
        out["rollout_log_probs"] = logprobs
    return out


def engine_outputs_to_tensors(prompts: Sequence[Sequence[int]], outputs, pad_id: int,
                              response_len: int | None = None, prompt_len: int | None = None):
    """Engine results (`outputs[i].outputs[j]` for sample j of `prompts[i]`) -> (tensors, rows).

    Tensors follow the layout above plus `rollout_log_probs` [B*n, R], the engine's log-prob
    of each sampled token; `rows` holds each row's `finish_reason`. Row i*n + j is sample j of
    prompt i.
    """
    row_prompts, responses, logprobs, finish = [], [], [], []
    for prompt, request in zip(prompts, outputs):
        for sample in request.outputs:
            row_prompts.append(list(prompt))
            responses.append(list(sample.token_ids))
            logprobs.append(list(sample.logprobs))
            finish.append(sample.finish_reason)
    tensors = sequence_tensors(row_prompts, responses, pad_id, response_len, prompt_len, logprobs)
    return tensors, {"finish_reason": finish}


def trim_padding(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row: left of the longest prompt and right of
    the longest response. Sequence-wide keys lose both, response-aligned keys ([B, R]) the right.
    Results do not change: padding is masked out of attention and positions start at the first
    real token."""
    R = tensors["response_mask"].shape[1]
    mask = tensors["attention_mask"]
    P = mask.shape[1] - R
    first = P - _max(mask[:, :P].sum(-1))  # prompts are left-padded
    last = _max(mask[:, P:].sum(-1))       # responses are right-padded
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.ndim < 2:
            out[key] = value
        elif value.shape[1] == P + R:
            out[key] = value[:, first:P + last]
        elif value.shape[1] == R:
            out[key] = value[:, :last]
        else:
            out[key] = value
    return out


def pad_to_widths(tensors: dict[str, torch.Tensor], prompt_len: int, response_len: int) -> dict[str, torch.Tensor]:
    """The inverse of `trim_padding`: prompts left-padded to `prompt_len`, responses (and every
    response-aligned key) right-padded to `response_len`, with 0 (padding is masked out
    everywhere, so its value never matters)."""
    R = tensors["response_mask"].shape[1]
    P = tensors["attention_mask"].shape[1] - R
    if prompt_len < P or response_len < R:
        raise ValueError(f"widths {P} / {R} do not fit in {prompt_len} / {response_len}")
    out = {}
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] in (P + R, R):
            left = prompt_len - P if value.shape[1] == P + R else 0
            out[key] = F.pad(value, (0, 0) * (value.ndim - 2) + (left, response_len - R))
        else:
            out[key] = value
    return out


def concat_rollouts(batches: Sequence[Batch]) -> Batch:
    """Rollout Batches from several engine calls (each padded to its own longest prompt and
    response) as one Batch, padded to the widest."""
    P = max(prompt_length(b) for b in batches)
    R = max(b["response_mask"].shape[1] for b in batches)
    return Batch.concat([Batch({**b.objects, **pad_to_widths(b.tensors, P, R)}, b.meta) for b in batches])


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
    (prompt_groups), the rows of a group go together, so that their prompt is packed once."""
    n = len(tokens)
    if not balance:
        return [idx for idx in torch.arange(n).tensor_split(count)]
    units: dict[int, list[int]] = {}
    for i, g in enumerate(range(n) if groups is None else groups.tolist()):
        units.setdefault(g, []).append(i)
    per_row = tokens.tolist()
    weighed = sorted(((sum(per_row[i] for i in rows), rows) for rows in units.values()), key=lambda u: -u[0])
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for weight, rows in weighed:
        k = min(range(count), key=load.__getitem__)
        bins[k].extend(rows)
        load[k] += weight
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_rows: int = 1024):
    """log pi(token) = log_softmax(logits / T)[token], T = 1 when temperature is 0 (greedy);
    entropy H = -sum_v p_v log p_v of the same distribution. Computed in fp32, `chunk_rows`
    positions at a time: the fp32 [rows, vocab] buffers exist for one chunk only, in the backward
    too (each chunk is recomputed there rather than stored), so a 152k vocabulary costs
    ~0.6 GB per buffer instead of batch x length x vocab x 4 bytes."""
    # split, not slicing: one backward node gathers the chunks' gradients into one tensor,
    # where each slice would add a full-size gradient of its own
    chunks = list(zip(logits.split(chunk_rows), tokens.split(chunk_rows))) or [(logits, tokens)]
    recompute = torch.is_grad_enabled() and logits.requires_grad and len(chunks) > 1
    parts = [checkpoint(_chunk_log_probs, x, t, temperature, with_entropy, use_reentrant=False)
             if recompute else _chunk_log_probs(x, t, temperature, with_entropy) for x, t in chunks]
    logp = torch.cat([p for p, _ in parts])
    entropy = torch.cat([e for _, e in parts]) if with_entropy else None
    return logp, entropy


def _chunk_log_probs(logits, tokens, temperature, with_entropy):
    logits = logits.float()
    if temperature not in (0, 1):
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
