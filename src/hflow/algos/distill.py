"""On-policy distillation's per-token signal: a divergence of the student's next-token distribution
from a frozen teacher's, over the whole vocabulary, at every position the student sampled.

    reverse_kl   D_t = sum_v p_s(v) (log p_s(v) - log p_t(v))          KL(student || teacher)
    jsd          D_t = beta KL(p_t || m) + (1 - beta) KL(p_s || m),     m = (1 - beta) p_s + beta p_t
                 (GKD, Agarwal et al. 2024; beta 0 is KL(teacher || student), beta 1 KL(student || teacher),
                 as TRL's GKDTrainer.generalized_jsd_loss has them)

The peers split on the form (verl's on-policy distillation, Thinking Machines' and slime use the
sampled token's log-ratio log p_s(x_t) - log p_t(x_t) as a per-token advantage; TRL's GKD the full
divergence). The sampled log-ratio is one-sample estimate of the reverse KL whose gradient only
reaches the sampled token; the full divergence is exact and differentiates through every logit. With
the teacher beside the student (hflow.workers.teacher) its logits are at hand, so the loss here is
the exact one and the sampled log-ratio is logged beside it (`sampled_kl`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hflow.algos.losses import policy_loss
from hflow.algos.masked import aggregate_loss, masked_mean
from hflow.algos.registry import Registry

DIVERGENCES = Registry("divergence")


@DIVERGENCES.register("reverse_kl")
def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """KL(p_s || p_t) per row of log-probs [K, V] -> [K]."""
    return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)


@DIVERGENCES.register("jsd")
def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence per row [K, V] -> [K] (module docstring)."""
    if not 0 <= beta <= 1:
        raise ValueError(f"the generalised JSD's beta must be in [0, 1], got {beta}")
    if beta == 0:
        return reverse_kl(teacher_logp, student_logp)
    if beta == 1:
        return reverse_kl(student_logp, teacher_logp)
    mixture = torch.logaddexp(student_logp + math.log1p(-beta), teacher_logp + math.log(beta))
    return beta * reverse_kl(teacher_logp, mixture) + (1 - beta) * reverse_kl(student_logp, mixture)


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "reverse_kl",
                     beta: float = 0.5) -> torch.Tensor:
    """The divergence `kind` of the student's distribution from the teacher's at each of K
    positions, from their logits [K, V] (fp32 whatever the models compute in); the gradient
    reaches the student's logits."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models must share the vocabulary")
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    return DIVERGENCES.find(kind)(student, teacher, beta)


def distill_loss(log_probs, mb, entropy=None, *, reward_weight: float = 0.0, clip: float = 0.2,
                 agg: str = "token-mean"):
    """The distillation loss on a micro-batch of the student's own samples: the per-token
    divergence (`mb["divergence"]`, carrying the gradient; hflow.workers.teacher puts it there)
    aggregated as `agg`, plus `reward_weight` times the clipped policy loss on the task reward's
    advantages (`mb["advantages"]`; on-policy, so the old log-probs are the current ones and the
    ratio is 1). Metrics: divergence (its token mean), sampled_kl (mean of log p_s(x_t) - log
    p_t(x_t) on the sampled tokens, the peers' estimator of the reverse KL) and, with a reward,
    policy_loss."""
    mask = mb["response_mask"]
    divergence = mb["divergence"]
    loss = aggregate_loss(divergence, mask, agg)
    metrics = {"divergence": masked_mean(divergence.detach(), mask).item(),
               "sampled_kl": masked_mean(mb["student_token_log_probs"] - mb["teacher_token_log_probs"], mask).item()}
    if reward_weight > 0:
        pg, pg_metrics = policy_loss(log_probs, log_probs.detach(), mb["advantages"], mask, clip_low=clip,
                                     clip_high=clip, agg=agg)
        loss = loss + reward_weight * pg
        metrics |= {"policy_loss": pg.item(), **pg_metrics}
    return loss, metrics
