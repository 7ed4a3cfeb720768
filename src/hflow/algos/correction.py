"""Rollout correction: the engine's samples weighted towards the trainer's policy.

The engine that samples (the behaviour policy μ, whose sampled-token log-probs are the batch's
`rollout_log_probs`) and the trainer that computes the update (π_old: the old log-probs, or
on-policy the update's own detached ones) are the same weights run by different code; in fp32
they agree to ~1e-6, in bf16 (or with a stale sample) they do not, and an update that takes
π_old/μ as exactly 1 follows a gradient of the wrong distribution. Importance weights fix
that, with a cap so that a rare token the engine under-rates cannot dominate a step:

    ρ_t = π_old(y_t) / μ(y_t)                           token level
    ρ   = Π_t ρ_t = exp Σ_t (log π_old − log μ)        sequence level (every token of y gets it)
    tis (truncated IS):  w = min(ρ, cap)
    mis (masked IS):     w = ρ where ρ ≤ cap, else 0    (a sample the engine got badly wrong is dropped)

The weights multiply the policy loss per token, with no gradient (verl's rollout correction,
TRL's vLLM importance sampling, OpenRLHF's TIS; MIS as in Yao et al.'s "off-policy RL" note).
With a cap above every ρ, sequence-level IS gives exactly the on-policy gradient under π_old
from μ's samples; token-level IS is the lower-variance, biased approximation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from hflow.algos.masked import masked_mean

CORRECTION_MODES = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


def mismatch_metrics(trainer_logp, rollout_logp, mask) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the sampled tokens:
    abs_log_ratio_mean / _max (|log π_old − log μ|), and kl_engine_trainer, the k3 estimate of
    KL(μ ‖ π_old) from μ's samples: mean of r − 1 − log r with r = π_old/μ."""
    m = torch.broadcast_to(mask.bool(), trainer_logp.shape)
    log_ratio = torch.where(m, trainer_logp.detach().float() - rollout_logp.float(), 0).clamp(-20, 20)
    return {"abs_log_ratio_mean": masked_mean(log_ratio.abs(), m).item(),
            "abs_log_ratio_max": log_ratio.abs().max().item() if m.any() else 0.0,
            "kl_engine_trainer": masked_mean(torch.expm1(log_ratio) - log_ratio, m).item()}


def importance_weights(trainer_logp, rollout_logp, mask, mode: str, level: str = "token",
                       cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights [B, R] (0 outside `mask`, no gradient) and their metrics:
    is_weight_mean (the weight actually applied, over tokens or sequences as `level` says) and
    capped_fraction (the share truncated by tis or dropped by mis). See the module docstring."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {CORRECTION_MODES}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; choose one of {CORRECTION_LEVELS}")
    if not cap > 0:
        raise ValueError(f"the rollout correction's cap must be > 0, got {cap}")
    m = torch.broadcast_to(mask.bool(), trainer_logp.shape)
    log_ratio = torch.where(m, trainer_logp.detach().float() - rollout_logp.float(), 0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
        counted = m.any(-1, keepdim=True)
    else:
        counted = m
    over = log_ratio > math.log(cap)
    # in log space: a sequence's ratio overflows float32 long before the cap is irrelevant
    if mode == "tis":
        weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    else:
        weights = torch.where(over, 0.0, torch.exp(log_ratio.clamp(max=math.log(cap))))
    metrics = {"is_weight_mean": masked_mean(weights, counted).item(),
               "capped_fraction": masked_mean(over.float(), counted).item()}
    return torch.where(m, torch.broadcast_to(weights, m.shape), 0.0), metrics


@dataclass(frozen=True)
class RolloutCorrection:
    """A recipe's --algo.rollout-correction* resolved, called in its actor loss on a micro-batch:

        weights, metrics = correction(mb)     # weights None when off
        loss, m = algos.policy_loss(logp, mb["old_log_probs"], ..., is_weights=weights)

    `measured` is False when the old log-probs are the engine's own (there is nothing to compare
    then, so neither weights nor metrics). Metrics go under mismatch/: the log-prob gap every
    step, the weights when a mode is on."""
    mode: Literal["none", "tis", "mis"] = "none"
    level: Literal["token", "sequence"] = "token"
    cap: float = 2.0
    measured: bool = True

    def __call__(self, mb) -> tuple[torch.Tensor | None, dict[str, float]]:
        if not self.measured:
            return None, {}
        trainer, engine, mask = mb["old_log_probs"], mb["rollout_log_probs"], mb["response_mask"]
        metrics = mismatch_metrics(trainer, engine, mask)
        weights = None
        if self.mode != "none":
            weights, weight_metrics = importance_weights(trainer, engine, mask, self.mode, self.level, self.cap)
            metrics |= weight_metrics
        return weights, {f"mismatch/{k}": v for k, v in metrics.items()}
