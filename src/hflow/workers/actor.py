"""The policy (Actor) and the frozen policy (Reference), FSDP2 on a causal LM.

Batches follow hflow/workers/layout.py. A loss function comes from the recipe:

    loss_fn(log_probs [b, r], micro_batch, entropy=None) -> (loss, metrics)

called once per micro-batch, with `micro_batch` holding the batch's tensors for those rows
(padding columns trimmed, so [b, r] with r <= R) on the training device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from hflow.workers import layout
from hflow.workers.base import ModelWorker, as_tensors, batch_meta
from hflow.workers.fsdp import FSDPConfig, OptimConfig, build_model


@dataclass
class ActorConfig:
    """The policy model and how it is trained."""

    model_path: str = ""
    """Hugging Face directory of the policy (config.json + safetensors)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    epochs: int = 1
    """passes over each batch (PPO epochs)"""
    mini_batch_size: int = 0
    """prompts per optimizer step, each with its rollout.n samples (0: the whole batch)"""
    micro_batch_size: int = 8
    """sequences per forward/backward on one rank"""
    max_tokens_per_micro_batch: int = 0
    """token budget of a micro-batch on one rank, balanced over ranks (0: use micro_batch_size)"""
    loss_weighting: Literal["tokens", "sequences"] = "tokens"
    """micro-batch losses add up weighted by response tokens (token-mean losses) or by sequences (seq-mean losses)"""


class Actor(ModelWorker):
    """The policy: log-probs, PPO-style updates, and (see `generate`) rollouts."""

    flag_prefix = "actor"
    trainable = True
    output_key = "old_log_probs"

    def __init__(self, mesh: DeviceMesh, cfg: ActorConfig):
        if not cfg.model_path:
            raise ValueError(f"--{self.flag_prefix}.model-path is required (a Hugging Face directory)")
        model = build_model(cfg.model_path, mesh, cfg.fsdp, "causal_lm", trainable=self.trainable)
        super().__init__(mesh, model, cfg, cfg.optim if self.trainable else None)

    def _log_probs(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
        """Per-token log-probs of the responses: logits at positions P-1 .. P+R-2 predict the
        R response tokens; only those R+1 positions go through the LM head."""
        R = mb["response_mask"].shape[1]
        out = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                         position_ids=layout.position_ids(mb["attention_mask"]),
                         use_cache=False, logits_to_keep=R + 1)
        responses = mb["input_ids"][:, mb["input_ids"].shape[1] - R:]
        return layout.token_log_probs(out.logits[:, :-1], responses, temperature, with_entropy)

    @torch.no_grad()
    def log_probs(self, batch, temperature: float = 1.0, with_entropy: bool = False, key: str | None = None):
        """{key: [B, R] log-probs of the response tokens at `temperature`} (key: old_log_probs
        for the Actor, ref_log_probs for the Reference), plus `entropy` [B, R] if asked."""
        key = key or self.output_key
        self.model.eval()

        def forward(mb):
            logp, entropy = self._log_probs(layout.trim_padding(mb), temperature, with_entropy)
            return {key: logp, **({"entropy": entropy} if with_entropy else {})}

        return self.forward_rows(as_tensors(batch), forward)

    def update(self, batch, loss_fn: Callable, temperature: float | None = None,
               with_entropy: bool = False) -> dict[str, float]:
        """Train on a batch: `cfg.epochs` passes, one optimizer step per mini-batch. The
        temperature must be the rollout's (default: batch.meta["temperature"], else 1); the
        number of samples per prompt is batch.meta["n"] (default 1)."""
        meta = batch_meta(batch)
        temperature = temperature if temperature is not None else meta.get("temperature", 1.0)

        def loss_of(mb):
            logp, entropy = self._log_probs(mb, temperature, with_entropy)
            return loss_fn(logp, self.wrap(mb, batch), entropy=entropy)

        return self.train(as_tensors(batch), int(meta.get("n", 1)), loss_of, self.cfg.epochs)

    @staticmethod
    def wrap(mb: dict[str, torch.Tensor], like):
        """Hand the loss function the same kind of object the worker was given."""
        if isinstance(like, dict):
            return mb
        return type(like)(mb, meta=batch_meta(like))


class Reference(Actor):
    """The frozen initial policy: `log_probs` only (key ref_log_probs), no optimizer state."""

    flag_prefix = "ref"
    trainable = False
    output_key = "ref_log_probs"

    def update(self, *args, **kwargs):
        raise TypeError("the Reference model is frozen: it has no update")
