"""Continuous batching: which sequences run in the next forward step.

Each step is either a prefill step (new sequences, their uncached prompt tokens packed
together, at most `max_num_batched_tokens` of them) or a decode step (one token for each
running sequence). Prefill goes first whenever a waiting sequence fits, so finished
sequences are replaced at once. When a decode step needs a block and none is free, the
newest running sequence is preempted: its blocks are freed and it waits at the head of the
queue to be recomputed (its tokens so far are prefilled again, mostly from the prefix cache).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hflow.engine.block_manager import BlockManager
from hflow.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        # called with each sequence that finished, before its blocks are freed (the runner
        # reads what is kept per KV slot: a MoE's routed experts)
        self.on_finish: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences, is_prefill) for the next step."""
        scheduled, num_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.can_allocate(seq)
            if cached is None:
                break
            new_tokens = len(seq) - min(cached, len(seq) - 1)
            # one sequence alone may exceed the budget, otherwise a long prompt would never run
            if scheduled and num_tokens + new_tokens > self.max_num_batched_tokens:
                break
            self.block_manager.allocate(seq)  # only now: allocation registers uncomputed blocks
            num_tokens += new_tokens
            seq.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        if not self.running:
            seq = self.waiting[0]
            raise RuntimeError(
                f"a sequence of {len(seq)} tokens does not fit in the KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size}): "
                "give the engine more KV memory (num_kv_blocks or kv_cache_bytes)")

        # decode: one token for each running sequence; preempt the newest while blocks lack
        bm = self.block_manager
        while sum(bm.needs_block_to_append(s) for s in self.running) > bm.num_free_blocks:
            self._preempt(self.running.pop())
        for seq in self.running:
            bm.append_slot(seq)
        return list(self.running), False

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop these sequences, waiting or running, and free their blocks."""
        dropped = {id(s) for s in seqs}
        for seq in self.running:
            if id(seq) in dropped:
                self.block_manager.deallocate(seq)
        self.running = deque(s for s in self.running if id(s) not in dropped)
        self.waiting = deque(s for s in self.waiting if id(s) not in dropped)

    def abort_all(self) -> None:
        """Drop every sequence (after a failed step) and free their blocks."""
        for seq in self.running:
            self.block_manager.deallocate(seq)
        self.running.clear()
        self.waiting.clear()

    def preempt_all(self) -> None:
        """Every running sequence back to the waiting queue, in order, its KV to be recomputed
        (new weights arrived between steps)."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """Append each sequence's sampled token; free the blocks of the sequences that
        finished; return them."""
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.append(token, logprob)
        done = [s for s in seqs if s.status == Status.FINISHED]
        if done:
            for seq in done:
                if self.on_finish is not None:
                    self.on_finish(seq)
                self.block_manager.deallocate(seq)
            done_ids = {id(s) for s in done}
            self.running = deque(s for s in self.running if id(s) not in done_ids)
        return done
