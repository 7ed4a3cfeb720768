"""Training passes on real tokens only: the rows of a micro-batch packed into one sequence.

A micro-batch in the layout of hflow/layout.py is [b, P + R] with left-padded prompts and
right-padded responses; run as it is, every matmul pays for b * (P + R) positions however
short most rows are. `pack` concatenates the real tokens of the rows, shortest first, into one
row of T tokens (positions restart at 0 for each sequence), and the attention function
registered here (`ATTENTION`, which hf_model.build_model sets on every worker model) attends within
each sequence only, from index tensors passed through the model's forward as the keyword
`hflow_packing`. The linear layers' work then follows the real tokens, and the LM head runs
only where a log-prob is read (`predict_at`).

Rows with the same prompt (the n samples of a GRPO group) carry it once: the first of them
in packed order (the leader) owns the prompt's tokens, the others only their responses, and
their attention reads the leader's prompt keys and values. A prompt's outputs do not depend
on what follows it, so log-probs and gradients are those of the unshared batch (the gradient
of the shared tokens sums over the rows that read them); on bench_rl's vary workload (16
prompts x 4, prompts 8-64 tokens) it cuts the update's tokens by 30 % and its time by 28 %.

    packed = pack(mb)
    out = model(**packed.model_inputs(), logits_to_keep=packed.predict_at)   # logits [1, K, V]
    logp = token_log_probs(out.logits.squeeze(0), packed.targets)            # [K]
    packed.unpack(logp)                                                      # [b, R], 0 elsewhere

Token j of row i (j = 0: its first prompt token) sits at packed index `start_i + j` when the
row owns its prompt, else at `start_leader + j` for j < p_i and `start_i + j - p_i` after;
a response token is predicted from the output of the token before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hflow.engine.attention import plan_buckets
from hflow.workers import micro_batches

ATTENTION = "hflow_varlen"

# A bucket's fixed cost (3 gathers, one SDPA call, a scatter, forward and backward) in units of
# the SDPA cost of one padded row of length 1 (cost ~ rows x L^2). Measured on 1 CPU thread,
# 25M model's heads (8 query / 4 KV x 64), one rank's share of bench_rl's vary workload (32
# sequences of 13-157 tokens): forward + backward per layer is flat within noise for 1,000-16,000
# (9-5 buckets), 48-52 ms, against 84-88 ms for one masked batch padded to the longest.
BUCKET_OVERHEAD = 8000
# lengths are rounded up to this for planning, so the plan costs O((L / 16)^2) at most
PLAN_GRANULE = 16


@dataclass
class Buckets:
    """Sequences of similar length, contiguous in the packed order, each bucket attended as one
    padded [rows, L] batch. `gather` [sum of rows x L] is the packed index of token j of each
    sequence of each bucket, row-major, bucket after bucket (padding: 0); `scatter` [T] is
    where each packed token's output is in that flat order."""
    shapes: list[tuple[int, int]]   # (rows, L) of each bucket
    gather: torch.Tensor
    scatter: torch.Tensor

    def __len__(self) -> int:
        return len(self.shapes)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     hflow_packing=None, sliding_window=None, **kwargs):
    """Causal attention inside each packed sequence (within the layer's `sliding_window`, which
    transformers passes for Mistral's, Qwen2's and Gemma 3's sliding layers: a query sees the
    `sliding_window` keys up to itself). query [1, H, T, D], key/value [1, H_kv, T, D]; returns
    [1, T, H, D] as transformers' attention functions do.

    The packed tokens of every bucket's rows are gathered at once (one index_select each for
    q, k and v: one full-size gradient each in the backward, not one per bucket) into padded
    [rows, H, L, D] batches, one causal `scaled_dot_product_attention` per bucket, then the
    outputs the packed tokens own are picked back out in packed order. Padding sits after each
    sequence's last token, so the causal mask alone keeps every real query off it; padding's and
    shared prompts' second outputs are dropped (their gradient is 0). Attention costs rows x L^2
    per bucket: buckets cut the padding where lengths vary."""
    if hflow_packing is None:
        raise RuntimeError(f"a model with attention {ATTENTION!r} runs on packed sequences: call it "
                           "with the inputs of hflow.workers.packing.pack(...).model_inputs()")
    if dropout > 0:
        raise ValueError("packed attention has no dropout")
    buckets: Buckets = hflow_packing
    if not len(buckets):   # an empty micro-batch
        return query.transpose(1, 2), None
    # token-major [T, h, D] views: transformers' q/k/v are [1, h, T, D] transposes of [1, T, h, D]
    # memory, so gathering and scattering along T keeps SDPA's preferred layout with no copy
    sizes = [b * L for b, L in buckets.shapes]
    pieces = zip(*(x[0].transpose(0, 1).index_select(0, buckets.gather).split(sizes) for x in (query, key, value)))
    outs = []
    for (b, L), (qb, kb, vb) in zip(buckets.shapes, pieces):
        qb, kb, vb = (x.view(b, L, *x.shape[1:]).transpose(1, 2) for x in (qb, kb, vb))   # [b, h, L, D]
        out = causal_attention(qb, kb, vb, scaling, sliding_window)
        outs.append(out.transpose(1, 2).reshape(b * L, out.shape[1], out.shape[3]))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, buckets.scatter)   # [T, H, D]
    return out.unsqueeze(0), None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention within each row: q [b, h, L, D], k/v [b, h_kv, L, D] (h_kv divides h)
    -> [b, h, L, D]; with a `window`, query i sees keys i - window < j <= i only (the row's
    column is its token's position). On CPU in bf16 as explicit matmuls with the softmax in fp32 (as
    transformers' eager attention): torch's CPU flash kernel took 2.0-2.6x their time there,
    forward + backward on one thread, at Qwen3-0.6B's heads (16 / 8 x 128) and at the 25M
    model's (8 / 4 x 64), over buckets of 46-157 tokens; in fp32 the flash kernel is the faster
    (fp64 and the unmeasured fp16 keep SDPA too)."""
    b, heads, L, D = q.shape
    windowed = window is not None and window < L
    if q.device.type != "cpu" or q.dtype != torch.bfloat16:
        if not windowed:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden_keys(L, window, q.device), scale=scale,
                                              enable_gqa=True)
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # the `group` query heads of a KV head as group x L query rows of it: K and V read once
    rows = q.unflatten(1, (kv_heads, group)).flatten(2, 3)                  # [b, h_kv, group * L, D]
    scores = (rows @ k.transpose(-1, -2)).float().mul_(D ** -0.5 if scale is None else scale)
    hidden = hidden_keys(L, window if windowed else None, q.device)
    scores = scores.view(b, kv_heads, group, L, L).masked_fill_(hidden, float("-inf"))
    weights = scores.softmax(-1).to(q.dtype).view(b, kv_heads, group * L, L)
    return (weights @ v).view(b, kv_heads, group, L, D).flatten(1, 2)


def hidden_keys(L: int, window: int | None, device) -> torch.Tensor:
    """[L, L] True where query i must not see key j: j > i, or (with a window) j <= i - window."""
    hidden = torch.ones(L, L, dtype=torch.bool, device=device).triu_(1)
    if window is not None:
        hidden |= torch.ones(L, L, dtype=torch.bool, device=device).tril_(-window)
    return hidden


def register_attention() -> str:
    """Make `ATTENTION` a transformers attention implementation (idempotent); returns its name.
    The sequence bounds replace the mask, so transformers builds none."""
    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
    return ATTENTION


@dataclass
class Packed:
    input_ids: torch.Tensor      # [1, T]
    position_ids: torch.Tensor   # [1, T]
    buckets: Buckets
    predict_at: torch.Tensor     # [K] packed indices whose output predicts (or values) a response token
    targets: torch.Tensor        # [K] those response tokens
    rows: torch.Tensor           # [K] where each goes in the [b, R] layout
    cols: torch.Tensor           # [K]
    last: torch.Tensor           # [b] packed index of each row's last token
    shape: tuple[int, int]       # (b, R)
    sources: torch.Tensor        # [T] where each packed token is in the flattened [b, P + R] layout

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "hflow_packing": self.buckets}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[K] per-response-token values -> [b, R], 0 where there is no response token."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def pack(tensors: dict[str, torch.Tensor], overhead: float = BUCKET_OVERHEAD, share_prompts: bool = True) -> Packed:
    """Pack the real tokens of a micro-batch in the layout of hflow/layout.py, shortest row first,
    and cut them into attention buckets (`overhead`: a bucket's fixed cost, see BUCKET_OVERHEAD).

    `share_prompts`: rows with the same prompt (the n samples of a prompt) carry its tokens
    once, in the first of them (the leader); the others hold only their responses and attend
    to the leader's prompt tokens. The prompt's outputs are the same for every row that starts
    with it (causal attention), so values and gradients do not change, and the linear layers
    pay for each prompt once."""
    mask = tensors["attention_mask"].bool()
    b, R = tensors["response_mask"].shape
    P = mask.shape[1] - R
    lengths = mask.sum(1)
    prompt_lengths = mask[:, :P].sum(1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError("a sequence has no prompt token: its first response token is predicted from nothing")
    order = torch.argsort(lengths, stable=True)
    all_rows = torch.arange(b, device=mask.device)
    rank = torch.empty_like(order).index_copy_(0, order, all_rows)                # row -> place in packed order
    if share_prompts and b > 1:
        groups = micro_batches.prompt_groups(tensors)
        first = torch.full_like(rank, b).scatter_reduce(0, groups, rank, "amin")  # group -> its leader's place
        leader = order[first[groups]]
    else:
        leader = all_rows
    shared = torch.where(leader != all_rows, prompt_lengths, 0)                  # tokens read from the leader
    owned = lengths - shared
    sorted_owned = owned[order]
    starts = torch.empty_like(order).index_copy_(0, order, sorted_owned.cumsum(0) - sorted_owned)

    def index_of(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed index of the token at `positions` (0 = the first prompt token) of `rows`."""
        return torch.where(positions < shared[rows], starts[leader[rows]] + positions,
                           starts[rows] + positions - shared[rows])

    owned_mask = mask.clone()
    owned_mask[:, :P] &= (shared == 0)[:, None]
    sorted_mask = owned_mask[order]
    input_ids = tensors["input_ids"][order][sorted_mask]
    positions = (mask[order].long().cumsum(1) - 1)[sorted_mask]
    rows, cols = mask[:, P:].nonzero(as_tuple=True)
    target_positions = prompt_lengths[rows] + cols
    target_at = index_of(rows, target_positions)
    buckets = _buckets(order, lengths, shared, index_of, overhead)
    return Packed(input_ids=input_ids[None], position_ids=positions[None], buckets=buckets,
                  predict_at=index_of(rows, target_positions - 1), targets=input_ids[target_at], rows=rows,
                  cols=cols, last=index_of(all_rows, lengths - 1), shape=(b, R),
                  sources=(order[:, None] * mask.shape[1] + torch.arange(mask.shape[1], device=mask.device))[sorted_mask])


def _buckets(order: torch.Tensor, lengths: torch.Tensor, shared: torch.Tensor, index_of,
             overhead: float) -> Buckets:
    """Cut rows (in packed `order`, shortest first) into buckets minimising sum(rows x L^2) +
    overhead x buckets. A bucket gathers each row's whole sequence (a shared prompt from its
    leader) and gives back the outputs of the tokens the row owns (all but a shared prompt)."""
    sorted_lengths = lengths[order].tolist()   # on the host: no device sync per bucket
    granules = [-(-n // PLAN_GRANULE) for n in sorted_lengths]
    spans = plan_buckets([g * g for g in granules], PLAN_GRANULE ** 2, overhead) if granules else []
    shapes, gathers, scatters, offset = [], [], [], 0
    for first, end in spans:
        rows = order[first:end]
        L = sorted_lengths[end - 1]
        j = torch.arange(L, device=lengths.device)[None, :]
        real = j < lengths[rows][:, None]                                           # [rows, L]
        gathers.append(torch.where(real, index_of(rows[:, None], j), 0).flatten())
        own = real & (j >= shared[rows][:, None])
        scatters.append(offset + (torch.arange(end - first, device=lengths.device)[:, None] * L + j)[own])
        shapes.append((end - first, L))
        offset += (end - first) * L
    empty = torch.zeros(0, dtype=torch.long, device=lengths.device)
    return Buckets(shapes, torch.cat(gathers) if gathers else empty, torch.cat(scatters) if scatters else empty)
