"""Runs one scheduled step: packs the batch, builds attention metadata, runs the model, samples.

Owns the KV cache: one tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim]
(K and V of every layer; the extra block is scratch, see attention.py), allocated at the
first step (so an engine built only to receive weights holds no cache yet). Masked-out
padding must never read NaN, so a block is zeroed before its first use: the block manager
hands fresh blocks out in order and counts them, and each step zeroes the newly touched
ones. Zeroing the whole budget up front cost more than generating at small batches (1 GiB:
~0.3 s on 2 cores, every time the engine wakes up).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hflow.engine.attention import AttentionMetadata, DecodeBucket, PrefillSeq, gathered_blocks, plan_buckets
from hflow.engine.block_manager import BlockManager
from hflow.engine.models.layers import PACKED_MIN_ROWS, can_pack
from hflow.engine.models.llama import CausalLM
from hflow.engine.sampler import sample
from hflow.engine.sequence import Sequence


@dataclass
class PrefillBatch:
    """The model's inputs for a prefill step of the distinct sequences, and how every scheduled
    sequence (leaders and their followers) reads its logits back."""
    input_ids: torch.Tensor        # [T] the uncached tokens of each distinct sequence, packed
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    last_rows: torch.Tensor        # [distinct] the packed row of each distinct sequence's last token
    logits_rows: torch.Tensor      # [scheduled] which of those rows each scheduled sequence samples from
    copies: list[tuple[int, int]]  # (leader block, follower block) to copy after the forward


# The matmuls switch to packed weights (models/layers.py) at a decode step of PACKED_MIN_ROWS to
# PACK_MAX_ROWS rows with at least PACK_MIN_STEPS steps ahead. Measured on the 2-core machine
# (25M model, idle): packing costs 50 ms at 1 thread (35 ms at 2); per decode step it saves
# 25-40 % of the matmul time at 4-16 rows, 7-12 % at 32, ~1-5 % at 64 (more when another
# process shares the caches, as the other rank of a 2-rank run does). Dropped when weights change.
PACK_MAX_ROWS = 32
PACK_MIN_STEPS = 24


class ModelRunner:
    def __init__(self, model: CausalLM, block_manager: BlockManager):
        self.model, self.block_manager = model, block_manager
        num_blocks, block_size = block_manager.num_blocks, block_manager.block_size
        self.num_blocks, self.block_size = num_blocks, block_size
        attn = model.layers[0].self_attn
        self.kv_shape = (2, len(model.layers), num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
        self.scratch_block = num_blocks
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.workspace: torch.Tensor | None = None
        self.num_zeroed_blocks = 0
        self.packable, self.packed = can_pack(self.model.lm_head_weight), False

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        attn = model.layers[0].self_attn
        elem = model.embed_tokens.weight.element_size()
        return 2 * len(model.layers) * block_size * attn.num_kv_heads * attn.head_dim * elem

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def allocate_kv_cache(self) -> None:
        """Allocate the cache if there is none; zero the blocks touched since the last call."""
        if self.kv_cache is None:
            w = self.model.embed_tokens.weight
            self.kv_cache = torch.empty(self.kv_shape, dtype=w.dtype, device=w.device)
            self.kv_cache[:, :, self.scratch_block].zero_()
            self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(self.kv_shape[1])]
            self.num_zeroed_blocks = 0
        touched = self.block_manager.num_touched_blocks
        if touched > self.num_zeroed_blocks:
            self.kv_cache[:, :, self.num_zeroed_blocks:touched].zero_()
            self.num_zeroed_blocks = touched

    def unpack_weights(self) -> None:
        """Drop the packed copies of the weights (stale once the weights change)."""
        if self.packed:
            self.model.pack_weights(False)
            self.packed = False

    def _maybe_pack(self, seqs: list[Sequence]) -> None:
        if self.packable and not self.packed and PACKED_MIN_ROWS <= len(seqs) <= PACK_MAX_ROWS and max(
                min(s.params.max_tokens - s.num_completion_tokens, s.max_len - len(s)) for s in seqs) >= PACK_MIN_STEPS:
            self.packed = self.model.pack_weights()

    def free_kv_cache(self) -> None:
        self.kv_cache, self.kv_caches, self.workspace = None, [], None

    def _workspace_for(self, meta: AttentionMetadata) -> torch.Tensor:
        """Grow-only scratch for the gathers of a step: K and V halves of the largest one."""
        need = 2 * gathered_blocks(meta) * self.kv_cache[0, 0, 0].numel()
        if self.workspace is None or self.workspace.numel() < need:
            self.workspace = torch.empty(max(need, 1), dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        return self.workspace

    # ---- batch preparation ----

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prepare_prefill(self, seqs: list[Sequence]) -> PrefillBatch:
        """Pack the uncached tokens of each *distinct* sequence.

        Sequences with identical tokens (the n samples of a fresh prompt) are computed once:
        a follower shares the leader's full blocks through the prefix cache, gets a copy of
        its other blocks after the forward, and samples from the leader's logits row.
        """
        ids, positions, slots, per_seq, last_rows = [], [], [], [], []
        leaders: dict[tuple[int, ...], tuple[int, Sequence]] = {}  # tokens -> (logits row, leader)
        logits_rows, copies = [], []
        scratch_slot = self.scratch_block * self.block_size
        for seq in seqs:
            key = tuple(seq.token_ids)
            if key in leaders:
                row, leader = leaders[key]
                first_own = seq.num_cached_tokens // self.block_size
                copies.extend((src, dst) for src, dst in zip(leader.block_table[first_own:], seq.block_table[first_own:])
                              if src != dst)
                logits_rows.append(row)
                continue
            leaders[key] = (len(last_rows), seq)
            start = min(seq.num_cached_tokens, len(seq) - 1)  # the last token is always recomputed
            per_seq.append(PrefillSeq(
                q_start=len(ids), q_len=len(seq) - start, ctx_len=len(seq),
                block_index=None if start == 0 else torch.tensor(seq.block_table, device=self.device)))
            ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            # a recomputed token whose KV is already cached is written to the scratch block
            slots.extend(scratch_slot if p < seq.num_cached_tokens else self._slot(seq, p)
                         for p in range(start, len(seq)))
            logits_rows.append(len(last_rows))
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata(slot_mapping=self._long(slots), prefill=per_seq)
        return PrefillBatch(self._long(ids), self._long(positions), meta, self._long(last_rows),
                            self._long(logits_rows), copies)

    def _prepare_decode(self, seqs: list[Sequence]):
        """`seqs` sorted by length; buckets are contiguous runs of them."""
        bs = self.block_size
        blocks_per_row = [-(-len(s) // bs) for s in seqs]
        width = blocks_per_row[-1]
        table = self._long([s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in seqs])
        lens = self._long([len(s) for s in seqs])
        buckets = []
        for start, end in plan_buckets(blocks_per_row, bs):
            nb = blocks_per_row[end - 1]
            buckets.append(DecodeBucket(start, end, table[start:end, :nb].reshape(-1), lens[start:end], nb * bs))
        positions = lens - 1
        slots = table.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        meta = AttentionMetadata(slot_mapping=slots, decode=buckets)
        return self._long([s.token_ids[-1] for s in seqs]), positions, meta

    def _long(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    # ---- one step ----

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], is_prefill: bool):
        """Run the model on the scheduled sequences and sample one token for each.

        Returns (sequences in the order used, token ids, log-probs) as Python lists.
        """
        self.allocate_kv_cache()
        if is_prefill:
            batch = self._prepare_prefill(seqs)
            batch.meta.use_workspace(self._workspace_for(batch.meta), self.kv_shape[3:])
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
            logits = self.model.compute_logits(hidden[batch.last_rows])[batch.logits_rows].float()
            if batch.copies:  # followers' own blocks: a copy of their leader's, every layer at once
                src, dst = self._long([c[0] for c in batch.copies]), self._long([c[1] for c in batch.copies])
                self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
        else:
            seqs = sorted(seqs, key=len)
            self._maybe_pack(seqs)
            input_ids, positions, meta = self._prepare_decode(seqs)
            meta.use_workspace(self._workspace_for(meta), self.kv_shape[3:])
            logits = self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_caches)).float()
        tokens, logprobs = sample(logits, seqs)
        tp = self.model.tp
        if tp.size > 1:  # rank 0's draw decides, so the ranks can never drift apart
            src = dist.get_global_rank(tp.group, 0)
            dist.broadcast(tokens, src, group=tp.group)
            dist.broadcast(logprobs, src, group=tp.group)
        return seqs, tokens.tolist(), logprobs.tolist()
