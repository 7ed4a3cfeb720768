"""Training passes on real tokens only: the rows of a micro-batch packed into one sequence.

A micro-batch in the layout of layout.py is [b, P + R] with left-padded prompts and
right-padded responses; run as it is, every matmul pays for b * (P + R) positions however
short most rows are. `pack` concatenates the real tokens of the rows, shortest first, into one
row of T tokens (positions restart at 0 for each sequence), and the attention function
registered here (`ATTENTION`, which fsdp.build_model sets on every worker model) attends within
each sequence only, from index tensors passed through the model's forward as the keyword
`hflow_packing`. The linear layers' work then follows the real tokens, and the LM head runs
only where a log-prob is read (`predict_at`).

    packed = pack(mb)
    out = model(**packed.model_inputs(), logits_to_keep=packed.predict_at)   # logits [1, K, V]
    logp = token_log_probs(out.logits[0], packed.targets)                    # [K]
    packed.unpack(logp)                                                      # [b, R], 0 elsewhere

Response token t of row i sits at packed index `start_i + p_i + t` (p_i real prompt tokens)
and is predicted from the output at the index before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hflow.engine.attention import plan_buckets

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
class Bucket:
    """Sequences of similar length, contiguous in the packed order, attended as one padded
    [rows, L] batch: `gather` [rows, L] is the index of token j of each sequence among the
    bucket's tokens (padding: 0), `scatter` [tokens] the index of each of its real tokens in
    the flattened [rows * L]."""
    gather: torch.Tensor
    scatter: torch.Tensor


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     hflow_packing=None, **kwargs):
    """Causal attention inside each packed sequence. query [1, H, T, D], key/value
    [1, H_kv, T, D]; returns [1, T, H, D] as transformers' attention functions do.

    The packed tokens are split into buckets of sequences of similar length; each bucket is
    gathered into one padded [rows, H, L, D] batch for a single causal
    `scaled_dot_product_attention` (one autograd node, not one slice per sequence: slicing's
    backward writes a full-size gradient per slice), then scattered back to its real tokens.
    Padding sits after each sequence's last token, so the causal mask alone keeps every real
    query off it; the padding queries' outputs are dropped (their gradient is 0). Attention
    costs rows x L^2 per bucket: buckets cut the padding where lengths vary."""
    if hflow_packing is None:
        raise RuntimeError(f"a model with attention {ATTENTION!r} runs on packed sequences: call it "
                           "with the inputs of hflow.workers.packing.pack(...).model_inputs()")
    if dropout > 0:
        raise ValueError("packed attention has no dropout")
    sizes, buckets = hflow_packing
    if not buckets:   # an empty micro-batch
        return query.transpose(1, 2), None
    # token-major [T, h, D] views: transformers' q/k/v are [1, h, T, D] transposes of [1, T, h, D]
    # memory, so gathering and scattering along T keeps SDPA's preferred layout with no copy
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    pieces = zip(*(x.split(sizes) for x in (q, k, v))) if len(buckets) > 1 else [(q, k, v)]
    outs = []
    for bucket, (qb, kb, vb) in zip(buckets, pieces):
        b, L = bucket.gather.shape

        def padded(x):  # [T_bucket, h, D] -> [b, h, L, D]
            return x.index_select(0, bucket.gather.flatten()).view(b, L, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(qb), padded(kb), padded(vb), is_causal=True,
                                             scale=scaling, enable_gqa=True)   # [b, H, L, D]
        outs.append(out.transpose(1, 2).reshape(b * L, out.shape[1], out.shape[3]).index_select(0, bucket.scatter))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)   # [T, H, D]
    return out.unsqueeze(0), None


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
    sizes: list[int]             # tokens of each bucket, in packed order
    buckets: list[Bucket]
    predict_at: torch.Tensor     # [K] packed indices whose output predicts (or values) a response token
    targets: torch.Tensor        # [K] those response tokens
    rows: torch.Tensor           # [K] where each goes in the [b, R] layout
    cols: torch.Tensor           # [K]
    last: torch.Tensor           # [b] packed index of each row's last token
    shape: tuple[int, int]       # (b, R)

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "hflow_packing": (self.sizes, self.buckets)}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[K] per-response-token values -> [b, R], 0 where there is no response token."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def pack(tensors: dict[str, torch.Tensor], overhead: float = BUCKET_OVERHEAD) -> Packed:
    """Pack the real tokens of a micro-batch in the layout of layout.py, shortest row first,
    and cut them into attention buckets (`overhead`: a bucket's fixed cost, see BUCKET_OVERHEAD)."""
    mask = tensors["attention_mask"].bool()
    b, R = tensors["response_mask"].shape
    P = mask.shape[1] - R
    lengths = mask.sum(1)
    prompt_lengths = mask[:, :P].sum(1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError("a sequence has no prompt token: its first response token is predicted from nothing")
    order = torch.argsort(lengths, stable=True)
    sorted_lengths = lengths[order]
    sorted_starts = sorted_lengths.cumsum(0) - sorted_lengths
    starts = torch.empty_like(sorted_starts).index_copy_(0, order, sorted_starts)
    sorted_mask = mask[order]
    input_ids = tensors["input_ids"][order][sorted_mask]
    positions = (sorted_mask.long().cumsum(1) - 1)[sorted_mask]
    rows, cols = mask[:, P:].nonzero(as_tuple=True)
    target_at = starts[rows] + prompt_lengths[rows] + cols
    sizes, buckets = _buckets(sorted_lengths, overhead)
    return Packed(input_ids=input_ids[None], position_ids=positions[None], sizes=sizes, buckets=buckets,
                  predict_at=target_at - 1, targets=input_ids[target_at], rows=rows, cols=cols,
                  last=starts + lengths - 1, shape=(b, R))


def _buckets(sorted_lengths: torch.Tensor, overhead: float) -> tuple[list[int], list[Bucket]]:
    """Cut rows sorted by length into buckets minimising sum(rows x L^2) + overhead x buckets."""
    granules = [-(-int(n) // PLAN_GRANULE) for n in sorted_lengths.tolist()]
    spans = plan_buckets([g * g for g in granules], PLAN_GRANULE ** 2, overhead) if granules else []
    sizes, buckets = [], []
    for first, end in spans:
        lengths = sorted_lengths[first:end]
        L = int(lengths[-1])
        j = torch.arange(L, device=lengths.device)
        real = j[None, :] < lengths[:, None]                                     # [rows, L]
        starts = lengths.cumsum(0) - lengths
        gather = torch.where(real, starts[:, None] + j[None, :], 0)
        scatter = (torch.arange(end - first, device=lengths.device)[:, None] * L + j[None, :])[real]
        sizes.append(int(lengths.sum()))
        buckets.append(Bucket(gather, scatter))
    return sizes, buckets
