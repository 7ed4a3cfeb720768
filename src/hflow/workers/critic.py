"""The value model (Critic): a causal-LM backbone with a scalar head, FSDP2.

`values[:, t]` is V(s_t), the value of the state *before* response token t, read at sequence
position P + t - 1 — the same position whose logits give the token's log-prob.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow import layout
from hflow.workers import packing
from hflow.workers.actor import Actor
from hflow.workers.base import ModelWorker, TrainingConfig, as_tensors, batch_meta
from hflow.workers.hf_model import build_model
from hflow.workers.micro_batches import packed_row_tokens
from hflow.workers.optim import OptimConfig


@dataclass
class CriticConfig(TrainingConfig):
    """The value model and how it is trained."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model_path: str = ""
    """Hugging Face directory of the value model; a causal LM (e.g. the actor's) gets a new scalar head"""
    head_init_seed: int = 0
    """seed of the new value head's initialisation"""


class Critic(ModelWorker):
    """`values(batch)` and `update(batch, loss_fn)` with loss_fn(values, micro_batch) -> (loss, metrics)."""

    flag_prefix = metric_prefix = "critic"

    def __init__(self, mesh: DeviceMesh, cfg: CriticConfig, default_model_path: str = ""):
        path = cfg.model_path or default_model_path
        if not path:
            raise ValueError("--critic.model-path is required (a value model, or a causal LM to start from)")
        model = build_model(path, mesh, cfg.fsdp, "value", head_init_seed=cfg.head_init_seed)
        super().__init__(mesh, model, cfg, cfg.optim)

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = packing.pack(mb)
        out = self.model(**packed.model_inputs())
        return packed.unpack(out.logits[0, packed.predict_at, 0].float())

    @dispatch("dp", balance=packed_row_tokens)
    @torch.no_grad()
    def values(self, batch) -> Batch:
        """{"values": [B, R]}, 0 outside response_mask."""
        self.model.eval()
        return Batch(self.forward_rows(as_tensors(batch), lambda mb: {"values": self._values(layout.trim_padding(mb))}))

    @dispatch("dp", balance=packed_row_tokens)
    def update(self, batch, loss_fn: Callable, loss_agg: str = "token-mean") -> dict[str, float]:
        """Train on a batch (epochs x mini-batches as the Actor); loss_fn(values [b, r],
        micro_batch) -> (loss, metrics), aggregated as `loss_agg` (see Actor.update).
        Returns critic/loss, critic/grad_norm, critic/lr, critic/skipped_steps, ..."""
        def loss_of(mb):
            return loss_fn(self._values(mb), Actor.wrap(mb, batch))

        return self.train(as_tensors(batch), int(batch_meta(batch).get("n", 1)), loss_of, self.cfg.epochs,
                          loss_agg)
