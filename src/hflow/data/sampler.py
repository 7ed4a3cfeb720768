"""Batches of prompts in a per-epoch shuffled order that a checkpoint can save and resume.

Epoch ``e`` visits the prompts in the order ``permutation(N)`` drawn from a generator seeded
with ``(seed, e)``: the order depends on the seed and the epoch only, not on what ran before, so
``(epoch, position)`` is the whole state and a resumed run yields exactly the batches an
uninterrupted one would.

Drop-last policy (training): with N prompts and batch size B, an epoch yields N // B batches of
exactly B prompts; the N % B prompts that the epoch's order puts last sit that epoch out (a
different random set each epoch). Every RL step thus sees B prompts, which keeps groups, data-
parallel splits and the step size uniform. ``iter_batches`` makes one ordered pass with a short
last batch instead (evaluation).
"""
from typing import Iterator

import numpy as np

from hflow.data.loading import Prompt, PromptDataset


class PromptSampler:
    """An endless iterator of ``list[Prompt]`` batches (``next(sampler)``), epoch after epoch."""

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"--data.batch-size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size:
            raise ValueError(f"--data.batch-size {batch_size} is more than the {len(dataset)} prompts "
                             f"of {dataset.source or 'the dataset'}: lower it or add prompts")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0  # position: batches already yielded in this epoch
        self._order_epoch, self._order = None, None

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The order in which ``epoch`` visits the dataset's rows."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> "PromptSampler":
        return self

    def __next__(self) -> list[Prompt]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        rows = self.order(self.epoch)[start:start + self.batch_size]
        self.position += 1
        return [self.dataset[int(i)] for i in rows]

    def state_dict(self) -> dict:
        """Plain ints: where the next batch starts, and what must match to resume."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "shuffle", "batch_size", "num_prompts"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(f"cannot resume the prompt order: the checkpoint has {key}={state[key]} but "
                                 f"this run has {mine}; resume with the same data and --data flags")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def iter_batches(dataset: PromptDataset, batch_size: int) -> Iterator[list[Prompt]]:
    """One pass in dataset order, the last batch possibly short (for evaluation)."""
    for start in range(0, len(dataset), batch_size):
        yield [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
