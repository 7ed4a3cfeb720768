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

from typing import Sequence

import torch
import torch.nn.functional as F

from hflow.batch import Batch


def pad_id(tokenizer_or_config) -> int:
    """The id that fills a row's padding: the pad token, else the EOS (the first of several),
    else 0. A tokenizer and a model config answer alike; the value never reaches a loss or a
    forward (the masks decide), it is only the one convention for what padding holds."""
    pad = getattr(tokenizer_or_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer_or_config, "eos_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
    return 0 if pad is None else int(pad)


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
