"""Runs one scheduled step: packs the batch, builds attention metadata, runs the model, samples.

Owns the KV cache: one tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim]
(K and V of every layer; the extra block is scratch, see attention.py), allocated at the
first step (so an engine built only to receive weights holds no cache yet). Masked-out
padding must never read NaN, so a block is zeroed before its first use: the block manager
hands fresh blocks out in order and counts them, and each step zeroes the newly touched
ones. Zeroing the whole budget up front cost more than generating at small batches (1 GiB:
~0.3 s on 2 cores, every time the engine wakes up).

A step talks to the device twice: its metadata (token ids, positions, slots, block tables,
context lengths, the sampler's uniforms...) is built in Python lists and sent in one copy
(StepBuffer), and the sampled tokens and log-probs come back in one copy. Nothing in between
waits for the device (whether a mask is needed is decided from Python lengths), so on a GPU
the host can queue the whole forward while the device runs. `num_copies` counts both kinds.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hflow.engine.attention import AttentionMetadata, DecodeBucket, PrefillSeq, gathered_blocks, plan_buckets
from hflow.engine.block_manager import BlockManager
from hflow.engine.models.layers import can_pack
from hflow.engine.models.llama import CausalLM
from hflow.engine.sampler import host_inputs, sample
from hflow.engine.sequence import Sequence


class StepBuffer:
    """A step's metadata gathered on the host and sent to the device in one copy: segments of
    int64 values, and float64 ones carried as their bit patterns (read back as a float64 view)."""

    def __init__(self):
        self.values: list[int] = []
        self.segments: list[tuple[int, int, bool]] = []   # (start, end, is_float)

    def add(self, ints) -> int:
        """Append a segment of ints; returns its index in send()'s list."""
        return self._add(ints, False)

    def add_floats(self, floats) -> int:
        return self._add(array("q", array("d", floats).tobytes()), True)

    def _add(self, values, is_float: bool) -> int:
        start = len(self.values)
        self.values.extend(values)
        self.segments.append((start, len(self.values), is_float))
        return len(self.segments) - 1

    def send(self, runner: "ModelRunner") -> list[torch.Tensor]:
        """The segments as device tensors: views of one int64 tensor copied once."""
        flat = runner.to_device(self.values)
        return [flat[a:b].view(torch.float64) if f else flat[a:b] for a, b, f in self.segments]


@dataclass
class PrefillBatch:
    """The model's inputs for a prefill step of the distinct sequences, and how every scheduled
    sequence (leaders and their followers) reads its logits back."""
    input_ids: torch.Tensor        # [T] the uncached tokens of each distinct sequence, packed
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    last_rows: torch.Tensor        # [distinct] the packed row of each distinct sequence's last token
    logits_rows: torch.Tensor      # [scheduled] which of those rows each scheduled sequence samples from
    copies: tuple[torch.Tensor, torch.Tensor] | None  # (leader blocks, follower blocks) to copy after the forward


# The matmuls switch to packed weights (models/layers.py) at a decode step of at most
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
        self.cdf_scratch: torch.Tensor | None = None
        self.num_zeroed_blocks = 0
        # a MoE's routed experts per KV slot, [num_blocks + 1, block_size, moe layers, top_k]:
        # kept beside the cache so that prefix-cached tokens (a GRPO group's shared prompt) keep theirs
        moe_layers = getattr(model, "moe_layers", None)
        self.routing_shape = (num_blocks + 1, block_size, len(moe_layers), model.top_k) if moe_layers else None
        self.routing: torch.Tensor | None = None
        self.packable, self.packed = can_pack(self.model.lm_head_weight), False
        self.num_copies = {"to_device": 0, "to_host": 0}

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        attn = model.layers[0].self_attn
        elem = model.embed_tokens.weight.element_size()
        routing = len(getattr(model, "moe_layers", ())) * getattr(model, "top_k", 0) * 4   # int32 experts a token
        return 2 * len(model.layers) * block_size * attn.num_kv_heads * attn.head_dim * elem + block_size * routing

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
            if self.routing_shape is not None:
                self.routing = torch.zeros(self.routing_shape, dtype=torch.int32, device=w.device)
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
        if self.packable and not self.packed and len(seqs) <= PACK_MAX_ROWS and max(
                min(s.params.max_tokens - s.num_completion_tokens, s.max_len - len(s)) for s in seqs) >= PACK_MIN_STEPS:
            self.packed = self.model.pack_weights()

    def free_kv_cache(self) -> None:
        self.kv_cache, self.kv_caches, self.workspace, self.cdf_scratch = None, [], None, None
        self.routing = None

    def _record_routing(self, slots: torch.Tensor) -> None:
        """Keep the experts the forward just chose, at its tokens' KV slots."""
        if self.routing is not None:
            self.routing.view(-1, *self.routing_shape[2:]).index_copy_(0, slots, self.model.routed_experts)

    def routed_experts(self, seq: Sequence) -> torch.Tensor | None:
        """[len(seq) - 1, moe layers, top_k] (on the host): the experts of every token of `seq`
        forwarded so far (its last, just sampled, is not). Read before its blocks are freed."""
        if self.routing is None:
            return None
        positions = torch.arange(len(seq) - 1)
        blocks = torch.tensor(seq.block_table, dtype=torch.long)[positions // self.block_size]
        slots = (blocks * self.block_size + positions % self.block_size).to(self.routing.device)
        return self.routing.view(-1, *self.routing_shape[2:]).index_select(0, slots).cpu()

    def _workspace_for(self, meta: AttentionMetadata) -> torch.Tensor:
        """Grow-only scratch for the gathers of a step: K and V halves of the largest one."""
        need = 2 * gathered_blocks(meta) * self.kv_cache[0, 0, 0].numel()
        if self.workspace is None or self.workspace.numel() < need:
            self.workspace = torch.empty(max(need, 1), dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        return self.workspace

    def _cdf_scratch(self, logits: torch.Tensor) -> torch.Tensor:
        """Grow-only float64 scratch for the sampler's cdf (rows x vocab)."""
        if self.cdf_scratch is None or self.cdf_scratch.numel() < logits.numel():
            self.cdf_scratch = torch.empty(logits.numel(), dtype=torch.float64, device=logits.device)
        return self.cdf_scratch

    # ---- batch preparation ----

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prepare_prefill(self, seqs: list[Sequence], buf: StepBuffer):
        """Pack the uncached tokens of each *distinct* sequence.

        Sequences with identical tokens (the n samples of a fresh prompt) are computed once:
        a follower shares the leader's full blocks through the prefix cache, gets a copy of
        its other blocks after the forward, and samples from the leader's logits row.
        Returns a function that builds the PrefillBatch from buf.send()'s tensors.
        """
        ids, positions, slots, per_seq, last_rows = [], [], [], [], []
        leaders: dict[tuple[int, ...], tuple[int, Sequence]] = {}  # tokens -> (logits row, leader)
        logits_rows, src, dst = [], [], []
        scratch_slot = self.scratch_block * self.block_size
        for seq in seqs:
            key = tuple(seq.token_ids)
            if key in leaders:
                row, leader = leaders[key]
                first_own = seq.num_cached_tokens // self.block_size
                for a, b in zip(leader.block_table[first_own:], seq.block_table[first_own:]):
                    if a != b:
                        src.append(a)
                        dst.append(b)
                logits_rows.append(row)
                continue
            leaders[key] = (len(last_rows), seq)
            start = min(seq.num_cached_tokens, len(seq) - 1)  # the last token is always recomputed
            per_seq.append((PrefillSeq(q_start=len(ids), q_len=len(seq) - start, ctx_len=len(seq),
                                       block_index=None), None if start == 0 else buf.add(seq.block_table)))
            ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            # a recomputed token whose KV is already cached is written to the scratch block
            slots.extend(scratch_slot if p < seq.num_cached_tokens else self._slot(seq, p)
                         for p in range(start, len(seq)))
            logits_rows.append(len(last_rows))
            last_rows.append(len(ids) - 1)
        fields = [buf.add(x) for x in (ids, positions, slots, last_rows, logits_rows, src, dst)]

        def build(t: list[torch.Tensor]) -> PrefillBatch:
            for p, index in per_seq:
                if index is not None:
                    p.block_index = t[index]
            ids_t, pos_t, slots_t, last_t, rows_t, src_t, dst_t = (t[i] for i in fields)
            meta = AttentionMetadata(slot_mapping=slots_t, prefill=[p for p, _ in per_seq])
            return PrefillBatch(ids_t, pos_t, meta, last_t, rows_t, (src_t, dst_t) if src else None)
        return build

    def _prepare_decode(self, seqs: list[Sequence], buf: StepBuffer):
        """`seqs` sorted by length; buckets are contiguous runs of them. Returns a function that
        builds (input ids, positions, metadata) from buf.send()'s tensors."""
        bs, scratch = self.block_size, self.scratch_block
        lens = [len(s) for s in seqs]
        blocks_per_row = [-(-n // bs) for n in lens]
        ids = buf.add([s.token_ids[-1] for s in seqs])
        positions = buf.add([n - 1 for n in lens])
        slots = buf.add([s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens)])
        ctx = buf.add(lens)
        plans = []
        for start, end in plan_buckets(blocks_per_row, bs):
            nb = blocks_per_row[end - 1]
            flat = []
            for s in seqs[start:end]:
                flat.extend(s.block_table[:nb])
                flat.extend([scratch] * (nb - min(nb, len(s.block_table))))
            # lens are sorted: the bucket's shortest and longest context decide whether a mask is needed
            plans.append((start, end, buf.add(flat), nb * bs, lens[start], lens[end - 1]))

        def build(t: list[torch.Tensor]):
            buckets = [DecodeBucket(start, end, t[index], t[ctx][start:end], padded, shortest, longest)
                       for start, end, index, padded, shortest, longest in plans]
            return t[ids], t[positions], AttentionMetadata(slot_mapping=t[slots], decode=buckets)
        return build

    def to_device(self, values: list[int]) -> torch.Tensor:
        """The step's one host -> device copy (from pinned memory, not waiting on a GPU)."""
        self.num_copies["to_device"] += 1
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> list:
        """The step's one device -> host copy: it waits for the step's work."""
        self.num_copies["to_host"] += 1
        return tensor.tolist()

    # ---- one step ----

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], is_prefill: bool):
        """Run the model on the scheduled sequences and sample one token for each.

        Returns (sequences in the order used, token ids, log-probs) as Python lists.
        """
        self.allocate_kv_cache()
        buf = StepBuffer()
        if not is_prefill:
            seqs = sorted(seqs, key=len)
            self._maybe_pack(seqs)
        build = self._prepare_prefill(seqs, buf) if is_prefill else self._prepare_decode(seqs, buf)
        sampling = {k: (buf.add(v) if k == "top_k" else buf.add_floats(v)) for k, v in host_inputs(seqs).items()}
        sent = buf.send(self)
        if is_prefill:
            batch = build(sent)
            batch.meta.use_workspace(self._workspace_for(batch.meta), self.kv_shape[3:])
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
            self._record_routing(batch.meta.slot_mapping)
            logits = self.model.compute_logits(hidden[batch.last_rows])[batch.logits_rows].float()
            if batch.copies is not None:  # followers' own blocks: a copy of their leader's, every layer at once
                src, dst = batch.copies
                self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
                if self.routing is not None:
                    self.routing.index_copy_(0, dst, self.routing.index_select(0, src))
        else:
            input_ids, positions, meta = build(sent)
            meta.use_workspace(self._workspace_for(meta), self.kv_shape[3:])
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            self._record_routing(meta.slot_mapping)
            logits = self.model.compute_logits(hidden).float()
        tokens, logprobs = sample(logits, seqs, {k: sent[i] for k, i in sampling.items()}, self._cdf_scratch(logits))
        # one copy back: token ids are exact in float64, and so are fp32 log-probs
        out = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
        tp = self.model.tp
        if tp.size > 1:  # rank 0's draw decides, so the ranks can never drift apart
            dist.broadcast(out, dist.get_global_rank(tp.group, 0), group=tp.group)
        tokens, logprobs = self.to_host(out)
        return seqs, [int(t) for t in tokens], logprobs
