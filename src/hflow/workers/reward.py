"""A learned reward (or cost) model: AutoModelForSequenceClassification with one label, FSDP2;
frozen in the RL loop, trainable on preference pairs (recipes/reward_model.py).

The score of a sequence is the head's output at its last token (the last response token; the
last prompt token when the response is empty). transformers' own pooling picks the rightmost
token that is not `pad_token_id`, which is wrong when padding and EOS share an id; we read the
head's per-token output and index it ourselves.

A model started from a causal-LM directory (e.g. the policy) keeps its backbone and gets a new
score head; one started from a sequence-classifier directory loads its head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from tyro.conf import Suppress

from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow import layout
from hflow.workers import packing
from hflow.workers.base import ModelWorker, TrainingConfig, as_tensors
from hflow.workers.hf_model import build_model
from hflow.workers.optim import OptimConfig


@dataclass
class RewardModelConfig(TrainingConfig):
    """A reward or cost model (sequence classifier, one output) and, when trained, how. In the RL
    loop it must share the actor's tokenizer: it scores the actor's token ids."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_size: int = 8
    """sequences per forward on one rank (training: pairs per forward/backward)"""
    model_path: Suppress[str] = ""
    """Hugging Face directory: a sequence classifier, or a causal LM to start from (new head)"""
    head_init_seed: int = 0
    """seed of a new score head's initialisation"""
    trainable: Suppress[bool] = False
    """build the optimizer (recipes/reward_model.py); frozen otherwise"""
    epochs: Suppress[int] = 1
    mini_batch_size: Suppress[int] = 0


class RewardModel(ModelWorker):
    """`scores(batch) -> {"rm_scores": [B]}`; `update(pairs, loss_fn)` when trainable."""

    flag_prefix = metric_prefix = "rm"

    def __init__(self, mesh: DeviceMesh, cfg: RewardModelConfig):
        if not cfg.model_path:
            raise ValueError("--reward.model is required for a RewardModel (a Hugging Face directory)")
        model = build_model(cfg.model_path, mesh, cfg.fsdp, "reward", trainable=cfg.trainable,
                            head_init_seed=cfg.head_init_seed)
        super().__init__(mesh, model, cfg, cfg.optim if cfg.trainable else None)
        self._per_token = None
        model.score.register_forward_hook(self._keep_per_token)

    def _keep_per_token(self, module, args, output):
        self._per_token = output

    def _scores(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = packing.pack(mb)
        self.model(**packed.model_inputs())
        per_token, self._per_token = self._per_token, None
        return per_token[0, packed.last, 0].float()

    @dispatch("dp")
    @torch.no_grad()
    def scores(self, batch, key: str = "rm_scores") -> Batch:
        """{key: [B]}: the head's output at each sequence's last token."""
        self.model.eval()
        return Batch(self.forward_rows(as_tensors(batch), lambda mb: {key: self._scores(layout.trim_padding(mb))}))

    @dispatch("dp")
    def update(self, batch, loss_fn: Callable) -> dict[str, float]:
        """One optimizer step on preference pairs in the layout of `hflow.data.preference.pair_batch`
        (pair i = rows 2i, 2i+1; a rank gets whole pairs when the pair count divides by the ranks).
        loss_fn(scores [b], micro_batch) -> (loss, metrics), scores in row order. Returns
        rm/loss, rm/grad_norm, rm/lr and the loss function's metrics as rm/<name>."""
        if self.optimizer is None:
            raise TypeError("this RewardModel is frozen: spawn it with RewardModelConfig(trainable=True) to train it")
        # a mean over pairs: every pair (two rows) weighs the same, whatever its length
        return self.train(as_tensors(batch), 1, lambda mb: loss_fn(self._scores(mb), mb), epochs=1,
                          loss_agg="seq-mean-token-mean")

    def micro_batches(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Training keeps a pair's two rows in one micro-batch: the pairs are split as the base
        class splits rows (each pair's tokens counted together), then each becomes its 2 rows."""
        if "chosen" not in tensors or len(tensors["chosen"]) % 2:   # scoring a share cut mid-pair: rows will do
            return super().micro_batches(tensors)
        mask = tensors["attention_mask"]
        pairs = super().micro_batches({"attention_mask": torch.cat([mask[0::2], mask[1::2]], dim=1)})
        return [torch.stack([2 * p, 2 * p + 1], dim=1).flatten() for p in pairs]
