"""Paged KV cache bookkeeping: block tables, reference counts, prefix caching.

The cache holds `num_blocks` blocks of `block_size` token slots each. A sequence's block
table lists its blocks in order; token t lives in slot t % block_size of block
block_table[t // block_size].

Prefix caching: a *full* block is identified by a chained hash of its tokens and of every
token before it, `h_i = hash((h_{i-1}, tokens of block i))`. A sequence being allocated
reuses any block already holding the same prefix (its reference count goes up), so the n
samples of a prompt, and identical prompts across requests, store the prompt's full blocks
once. A block whose count drops to zero goes back to the free list but keeps its hash until
it is handed out again, so a later request can still revive it (an LRU cache of prefixes).
"""
from __future__ import annotations

from collections import OrderedDict

from hflow.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, least recently freed first; an OrderedDict so that a cache hit can
        # take a free block out of the middle in O(1)
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.peak_used_blocks = 0
        # blocks [0, num_touched_blocks) may have been handed out since the last reset: the
        # model runner zeroes the cache up to here (fresh blocks leave the free list in order)
        self.num_touched_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    # ---- allocation of a whole sequence (prefill) ----

    def _full_block_hashes(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(chained hash, tokens) of each full block of the sequence."""
        out, h, bs = [], 0, self.block_size
        for i in range(len(seq) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((h, tokens))
            out.append((h, tokens))
        return out

    def _lookup(self, h: int, tokens: tuple[int, ...]) -> Block | None:
        block_id = self.hash_to_block.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tokens else None  # guard against a hash collision

    def _cached_prefix(self, seq: Sequence) -> list[tuple[int, tuple[int, ...], Block | None]]:
        """Per full block: (hash, tokens, cached block or None). Hits stop at the first miss."""
        if not self.enable_prefix_caching:
            return []
        out, missed = [], False
        for h, tokens in self._full_block_hashes(seq):
            block = None if missed else self._lookup(h, tokens)
            missed = missed or block is None
            out.append((h, tokens, block))
        return out

    def can_allocate(self, seq: Sequence) -> int | None:
        """The tokens the prefix cache would supply, or None when the free list cannot cover
        the blocks this sequence needs beyond shared hits. Allocates nothing."""
        prefix = self._cached_prefix(seq)
        hits = [b for _, _, b in prefix if b is not None]
        needed = -(-len(seq) // self.block_size) - sum(1 for b in hits if b.ref_count > 0)
        return len(hits) * self.block_size if needed <= len(self.free) else None

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence its block table; sets seq.num_cached_tokens.

        num_cached_tokens may equal len(seq) when every block is a hit; the model runner still
        recomputes the last token (its logits are needed) but does not write its KV again.
        """
        assert not seq.block_table, "sequence already has blocks"
        bs, num_cached = self.block_size, 0
        prefix = self._cached_prefix(seq)
        for h, tokens, block in prefix:
            if block is None:
                block = self._take_free_block()
                # registered now, filled by this step's forward before any reader runs: so a
                # sequence must be allocated only once it is certain to run in this step
                self._register(block, h, tokens)
            else:
                if block.ref_count == 0:
                    del self.free[block.block_id]
                block.ref_count += 1
                num_cached += bs
            seq.block_table.append(block.block_id)
        for _ in range(len(prefix), -(-len(seq) // bs)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_cached_tokens = num_cached
        self._note_peak()

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: the tail is evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    # ---- decode: room for one more token ----

    def needs_block_to_append(self, seq: Sequence) -> bool:
        """Whether the KV of the last token (position len(seq) - 1) needs a new block."""
        return len(seq.block_table) * self.block_size < len(seq)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of the last token; hash the previous block once it is full."""
        bs = self.block_size
        if self.needs_block_to_append(seq):
            seq.block_table.append(self._take_free_block().block_id)
            self._note_peak()
        # the block holding tokens [len-1-bs, len-1) just became full: cache it
        num_full = (len(seq) - 1) // bs
        if self.enable_prefix_caching and num_full > 0 and (len(seq) - 1) % bs == 0:
            block = self.blocks[seq.block_table[num_full - 1]]
            if block.hash is None and block.ref_count == 1:
                parent = self.blocks[seq.block_table[num_full - 2]].hash if num_full > 1 else 0
                if parent is not None:
                    tokens = tuple(seq.token_ids[(num_full - 1) * bs:num_full * bs])
                    self._register(block, hash((parent, tokens)), tokens)

    # ---- internals ----

    def _take_free_block(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block_id >= self.num_touched_blocks:
            self.num_touched_blocks = block_id + 1
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its old content is about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _register(self, block: Block, h: int, tokens: tuple[int, ...]) -> None:
        block.hash, block.token_ids = h, tokens
        self.hash_to_block.setdefault(h, block.block_id)

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def reset(self) -> None:
        """Forget cached prefixes and which blocks were touched (after the cache was freed)."""
        self.reset_prefix_cache()
        # untouched blocks are still in order at the head of the free list: put the touched
        # ones back in front of them, in order (O(touched), not O(num_blocks))
        for block_id in range(self.num_touched_blocks - 1, -1, -1):
            self.free.move_to_end(block_id, last=False)
        self.num_touched_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after new weights, the cached KV is stale)."""
        assert self.num_used_blocks == 0, "reset_prefix_cache while sequences hold blocks"
        for block in self.blocks[:self.num_touched_blocks]:  # only handed-out blocks have a hash
            block.hash, block.token_ids = None, ()
        self.hash_to_block.clear()
