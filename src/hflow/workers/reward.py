"""A learned reward model: AutoModelForSequenceClassification with one label, FSDP2, frozen.

The score of a sequence is the head's output at its last response token (the last prompt
token when the response is empty). transformers' own pooling picks the rightmost token that
is not `pad_token_id`, which is wrong when padding and EOS share an id; we read the head's
per-token output and index it ourselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from hflow.batch import Batch
from hflow.dispatch import dispatch
from hflow.workers import layout, packing
from hflow.workers.base import ModelWorker, as_tensors
from hflow.workers.fsdp import FSDPConfig, build_model


@dataclass
class RewardModelConfig:
    """A reward model (sequence classifier with one output); it must share the actor's tokenizer."""

    model_path: str = ""
    """Hugging Face directory of the reward model (empty: no reward model)"""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    micro_batch_size: int = 8
    """sequences per forward on one rank"""
    max_tokens_per_micro_batch: int = 0
    """token budget of a micro-batch on one rank (0: use micro_batch_size)"""


class RewardModel(ModelWorker):
    """`scores(batch) -> {"rm_scores": [B]}`."""

    flag_prefix = "reward"

    def __init__(self, mesh: DeviceMesh, cfg: RewardModelConfig):
        if not cfg.model_path:
            raise ValueError("--reward.model-path is required for a RewardModel")
        model = build_model(cfg.model_path, mesh, cfg.fsdp, "reward", trainable=False)
        super().__init__(mesh, model, cfg)
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
    def scores(self, batch) -> Batch:
        """{"rm_scores": [B]}: the head's output at each sequence's last response token."""
        return Batch(self.forward_rows(as_tensors(batch), lambda mb: {"rm_scores": self._scores(layout.trim_padding(mb))}))
