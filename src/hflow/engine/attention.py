"""Attention over the paged KV cache, in portable PyTorch (gather + scaled_dot_product_attention).

Cache layout, per layer: k_cache, v_cache of shape [num_blocks, block_size, kv_heads, head_dim]
(the last block is a scratch block: padding of block tables points at it, and tokens whose KV
is already cached are written there).

Decode is memory-bound on CPU: reading the cache costs more than the layer's matmuls, and a
gather through the block tables writes a copy of what it reads. So the decode batch comes
sorted by context length and is cut into *buckets* (contiguous runs of rows); each bucket
gathers its blocks with one `index_select` on the flat block index, padded only to its own
longest context, and runs one SDPA call. The cut points minimise
    sum over buckets (rows x padded length) + overhead x number of buckets
(a tiny dynamic programme over the distinct block counts), i.e. the bytes read plus a fixed
price per extra call. Prefill runs one SDPA call per sequence: the fresh K/V directly when
nothing was cached (is_causal), otherwise the gathered context with a bottom-right causal mask,
query heads folded onto their KV head so that the mask never comes with enable_gqa.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# A bucket's fixed cost (index_select x2 + SDPA call + slicing) in cache tokens read. On the
# 2-core CPU (128 rows, contexts 20-150, 4 KV heads x 64) decode attention time is flat for
# values 40..640 (8-4 buckets), and 2.2x lower than one bucket padded to the longest context.
BUCKET_OVERHEAD_TOKENS = 160


@dataclass
class PrefillSeq:
    q_start: int                       # first row of this sequence in the packed batch
    q_len: int                         # new tokens computed in this step
    ctx_len: int                       # tokens attended to by the last one (cached + new)
    block_index: torch.Tensor | None   # [num_blocks] when part of the context is cached


@dataclass
class DecodeBucket:
    start: int                         # rows [start, end) of the decode batch
    end: int
    block_index: torch.Tensor          # [rows * blocks_per_row] flat block ids, padded with scratch
    ctx_lens: torch.Tensor             # [rows]
    padded_len: int                    # blocks_per_row * block_size
    shortest: int                      # the bucket's shortest and longest context (Python ints:
    longest: int                       # whether a mask is needed is known without the device)
    masks: dict = field(default_factory=dict)  # sliding window (or None) -> additive mask
    # set by AttentionMetadata.use_workspace: the workspace views the gathers write into
    # ([blocks, block_size, kv_heads, head_dim]) and the same memory as SDPA reads it
    # ([rows, kv_heads, padded_len, head_dim]); views built once per step, not per layer
    k_blocks: torch.Tensor | None = None
    v_blocks: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, 1, 1, padded_len] additive mask (0 where a key is visible, -inf elsewhere);
        None when every key is visible. Built once per step, shared by the layers."""
        if window not in self.masks:
            # key j of a row is visible iff ctx - window <= j < ctx: all are, iff every context
            # fills the padded length and none is longer than the window
            if self.shortest == self.padded_len and (window is None or self.longest <= window):
                self.masks[window] = None
            else:
                pos = torch.arange(self.padded_len, device=self.ctx_lens.device)
                ctx = self.ctx_lens[:, None]
                visible = pos[None, :] < ctx
                if window is not None:
                    visible &= pos[None, :] >= ctx - window
                self.masks[window] = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
                    ~visible, float("-inf"))[:, None, None, :]
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] flat cache slot for each new token's K/V
    prefill: list[PrefillSeq] | None = None
    decode: list[DecodeBucket] | None = None
    # flat scratch the gathers write into, >= 2 x the largest gather of the step: reusing one
    # buffer avoids a fresh multi-MB allocation per gather (page faults cost more than the copy)
    workspace: torch.Tensor | None = None

    def use_workspace(self, workspace: torch.Tensor, block_shape: tuple[int, int, int]) -> None:
        """Gather into `workspace` (K in its first half, V in its second); block_shape is
        (block_size, kv_heads, head_dim)."""
        self.workspace = workspace
        half = workspace.numel() // 2
        for b in self.decode or ():
            n = b.block_index.numel()
            size = n * block_shape[0] * block_shape[1] * block_shape[2]
            b.k_blocks = workspace[:size].view(n, *block_shape)
            b.v_blocks = workspace[half:half + size].view(n, *block_shape)
            shape = (b.end - b.start, b.padded_len, *block_shape[1:])
            b.k, b.v = b.k_blocks.view(shape).transpose(1, 2), b.v_blocks.view(shape).transpose(1, 2)


def gathered_blocks(meta: AttentionMetadata) -> int:
    """The most blocks one gather of this step reads (sizes the workspace)."""
    if meta.decode is not None:
        return max(b.block_index.numel() for b in meta.decode)
    return max((len(s.block_index) for s in meta.prefill if s.block_index is not None), default=0)


def _gather(cache: torch.Tensor, index: torch.Tensor, workspace: torch.Tensor, half: int) -> torch.Tensor:
    """cache[index] (whole blocks) into half `half` (0: K, 1: V) of the workspace."""
    block = cache[0].numel()
    n = index.numel() * block
    out = workspace[half * (workspace.numel() // 2):][:n].view(index.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, index, out=out)


def plan_buckets(blocks_per_row: list[int], block_size: int,
                 overhead_tokens: int = BUCKET_OVERHEAD_TOKENS) -> list[tuple[int, int]]:
    """Cut rows sorted by block count (ascending) into buckets [start, end).

    Rows with equal block counts are never split. cost(bucket) = rows * max_blocks *
    block_size + overhead_tokens; a dynamic programme over the g distinct counts, O(g^2).
    """
    # groups of equal block count: (first row, row count, blocks)
    groups: list[list[int]] = []
    for i, nb in enumerate(blocks_per_row):
        if groups and groups[-1][2] == nb:
            groups[-1][1] += 1
        else:
            groups.append([i, 1, nb])
    g = len(groups)
    best = [0.0] + [float("inf")] * g          # best[j]: cheapest plan for groups[:j]
    cut = [0] * (g + 1)
    for j in range(1, g + 1):
        rows = 0
        for i in range(j, 0, -1):               # bucket = groups[i-1 : j]
            rows += groups[i - 1][1]
            cost = best[i - 1] + rows * groups[j - 1][2] * block_size + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    spans, j = [], g
    while j > 0:
        i = cut[j]
        spans.append((groups[i][0], groups[j - 1][0] + groups[j - 1][1]))
        j = i
    return spans[::-1]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V ([tokens, kv_heads, head_dim]) at their flat slots."""
    kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim].

    Writes k/v into the cache first, so a sequence can read blocks that another sequence of
    the same step has just filled (the n samples of one prompt share them).
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode is not None:
        return _decode(q, k_cache, v_cache, meta.decode, scale, window)
    return _prefill(q, k, v, k_cache, v_cache, meta.prefill, meta.workspace, scale, window)


def _decode(q, k_cache, v_cache, buckets, scale, window):
    """One query token per row. The query heads sharing a KV head (GQA group of G) are
    presented as G query positions of that head: [rows, kv_heads, G, head_dim], which lets
    SDPA read each KV head once (measured ~10% faster than enable_gqa here)."""
    kv_heads, head_dim = k_cache.shape[2:]
    outs = []
    for b in buckets:
        torch.index_select(k_cache, 0, b.block_index, out=b.k_blocks)
        torch.index_select(v_cache, 0, b.block_index, out=b.v_blocks)
        outs.append(F.scaled_dot_product_attention(
            q[b.start:b.end].view(b.end - b.start, kv_heads, -1, head_dim), b.k, b.v,
            attn_mask=b.mask(window, q.dtype), scale=scale))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(q.shape)


def _prefill(q, k, v, k_cache, v_cache, seqs, workspace, scale, window):
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        if s.block_index is None:                            # nothing cached: the fresh K/V
            ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        else:
            n = len(s.block_index) * block_size
            ks = _gather(k_cache, s.block_index, workspace, 0).view(n, kv_heads, head_dim)[:s.ctx_len]
            vs = _gather(v_cache, s.block_index, workspace, 1).view(n, kv_heads, head_dim)[:s.ctx_len]
            ks, vs = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
        if s.block_index is None and (window is None or window >= s.ctx_len):  # plain causal
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], ks, vs, is_causal=True,
                                               scale=scale, enable_gqa=group > 1)
            out[rows] = o[0].transpose(0, 1)
        else:
            out[rows] = masked_prefill_attention(q[rows], ks, vs, s.ctx_len, window, scale)
    return out


def masked_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int,
                             window: int | None, scale: float) -> torch.Tensor:
    """q [q_len, heads, head_dim] at positions ctx_len - q_len .. ctx_len - 1, k/v [1, kv_heads,
    ctx_len, head_dim] -> [q_len, heads, head_dim], bottom-right causal (within `window`).

    As in _decode, the G query heads of a KV head become G x q_len query rows of that head: a
    mask never meets enable_gqa, which on CUDA leaves only the math kernel (a [heads, q_len,
    ctx_len] score matrix); folded, the memory-efficient kernel takes the mask.
    """
    q_len, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    # row r * q_len + i of KV head h is query i of head h * g + r
    qf = q.view(q_len, kv_heads, g, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, g * q_len, head_dim)
    mask = _causal_mask(q_len, ctx_len, window, q.device, repeat=g)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return o.view(kv_heads, g, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, heads, head_dim)


def _causal_mask(q_len: int, ctx_len: int, window: int | None, device, repeat: int = 1) -> torch.Tensor:
    """[repeat * q_len, ctx_len] True where query i (at position ctx_len - q_len + i; rows
    repeated `repeat` times) sees key j."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device).repeat(repeat)[:, None]
    kpos = torch.arange(ctx_len, device=device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= qpos - kpos < window
    return visible
