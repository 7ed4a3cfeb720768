"""Losses: the policy's (PPO's clipped surrogate, GSPO, CISPO, SAPO), the critic's, the supervised one, and
the KL estimators they use; the registry a recipe picks a policy loss from by name.

A loss returns `(loss, metrics)`: `loss` a 0-dim tensor carrying the gradient, `metrics` plain
Python floats. A policy loss in `POLICY_LOSSES` takes

    fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, agg, is_weights) -> (loss, metrics)

(`agg` one of AGG_MODES: how token losses add up over a micro-batch; `is_weights` None, or the
rollout correction's per-token weights (hflow.algos.correction) multiplying each token's loss).
A loss may take more keyword arguments of its own (SAPO's temperatures), passed by name.
"""
import torch

from hflow.algos.masked import aggregate_loss, masked_mean
from hflow.algos.registry import Registry

KL_KINDS = ("k1", "k2", "k3", "abs", "low_var_kl")
# exp() of a log-ratio beyond ±20 overflows to nonsense long before it is informative
_MAX_LOG_RATIO = 20.0

POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register   # a policy loss (the signature above), added as `name`
policy_loss_fn = POLICY_LOSSES.find


def kl_penalty(logp, ref_logp, kind):
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL").

    With d = logp − ref_logp:
      k1: d                       (unbiased, high variance, can be negative)
      k2: ½·d²                    (biased, low variance; its gradient is the KL's gradient)
      k3: exp(−d) + d − 1         (unbiased, low variance, ≥ 0)
      abs: |d|
      low_var_kl: k3 with −d clamped to ±20 and the result to ≤ 10, as verl (for stability)
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(-d) + d - 1
    if kind == "abs":
        return d.abs()
    if kind == "low_var_kl":
        neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(neg) - neg - 1).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")

def _log_ratio(logp, old_logp, mask):
    """(log π/π_old per token, bool mask): 0 at masked-out positions, clamped to ±20 (a ratio
    beyond e^±20 carries no gradient), no gradient to old_logp."""
    m = torch.broadcast_to(mask.bool(), logp.shape)
    return torch.where(m, logp - old_logp.detach(), 0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), m

def _k3_from_log_ratio(log_ratio, mask):
    """k3 estimate of KL(π_old ‖ π) from samples of π_old: mean of (r − 1) − log r."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item()


@register_policy_loss("ppo")
def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                agg="token-mean", is_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO's clip-higher and dual-clip.

    r = π/π_old = exp(logp − old_logp),  A = advantages (no gradient to old_logp or A):
      L = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))
      dual-clip (Ye et al. 2020), for A < 0 only:  L = min(L, −A·dual_clip)   (dual_clip > 1)
    times `is_weights` (the rollout correction's, if any), aggregated by `aggregate_loss(L, mask,
    agg)`; log r is clamped to ±20 for stability. metrics: clipfrac (share of tokens where the clipped term is the max), approx_kl (k3 estimate
    of KL(π_old ‖ π)), and with dual-clip clipfrac_lower (share of tokens capped by it).
    """
    log_ratio, m = _log_ratio(logp, old_logp, mask)
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {}
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (a cap of −A·c on the loss), got {dual_clip}")
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(capped, cap, loss_mat)
        metrics["clipfrac_lower"] = masked_mean(capped.float(), m).item()
    metrics["clipfrac"] = masked_mean((clipped > unclipped).float(), m).item()
    metrics["approx_kl"] = _k3_from_log_ratio(log_ratio.detach(), m)
    return aggregate_loss(_weighted(loss_mat, is_weights), m, agg), metrics


@register_policy_loss("gspo")
def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4,
                     agg="seq-mean-token-mean", is_weights=None):
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level, length-normalised ratio.

    s_i = exp( (1/|y_i|) Σ_t m·(logp − old_logp) ),  per token (the paper's GSPO-token form)
    s_it = sg[s_i] · π_t / sg[π_t],  L_it = max(−A_it·s_it, −A_it·clip(s_it, 1 − clip_low,
    1 + clip_high)). With A constant over a sequence and the default agg this is exactly the
    sequence-level objective mean_i max(−A_i·s_i, −A_i·clip(s_i)). Defaults are the paper's.
    metrics: clipfrac (share of tokens clipped), approx_kl (k3, as in `policy_loss`).
    """
    log_ratio, m = _log_ratio(logp, old_logp, mask)
    seq_log_ratio = masked_mean(log_ratio, m, dim=-1).detach()
    # forward value s_i at every token; gradient that of s_i·log π_t
    token_log_ratio = torch.where(m, logp - logp.detach(), 0) + seq_log_ratio[:, None]
    ratio = torch.exp(token_log_ratio)
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), m).item(),
        "approx_kl": _k3_from_log_ratio(log_ratio.detach(), m),
    }
    return aggregate_loss(_weighted(loss_mat, is_weights), m, agg), metrics


@register_policy_loss("cispo")
def cispo_policy_loss(logp, old_logp, advantages, mask, clip_low=None, clip_high=4.0, agg="token-mean",
                      is_weights=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped, detached importance weight.

    r = π/π_old,  w = sg[clip(r, 1 − clip_low, 1 + clip_high)],  L = −w·A·log π
    so that ∇L = −w·A·∇log π: a token whose ratio is clipped keeps its gradient, only its weight
    is capped (PPO drops it). `clip_low=None`: no lower bound (the paper's and TRL's choice); the
    default upper bound r ≤ 5 is TRL's recommended ε_max = 5.0 (ScaleRL) in this file's 1 + clip_high
    convention. The loss's value is −w·A·log π, not a surrogate near 0. log r is clamped to ±20.
    metrics: clipfrac (share of tokens whose weight is clipped), approx_kl (k3, as in `policy_loss`).
    """
    log_ratio, m = _log_ratio(logp, old_logp, mask)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(min=None if clip_low is None else 1 - clip_low, max=1 + clip_high)
    loss_mat = -weight * advantages.detach() * torch.where(m, logp, 0)
    metrics = {
        "clipfrac": masked_mean((weight != ratio).float(), m).item(),
        "approx_kl": _k3_from_log_ratio(log_ratio.detach(), m),
    }
    return aggregate_loss(_weighted(loss_mat, is_weights), m, agg), metrics


@register_policy_loss("sapo")
def sapo_policy_loss(logp, old_logp, advantages, mask, clip_low=None, clip_high=None, agg="seq-mean-token-mean",
                     is_weights=None, tau_pos=1.0, tau_neg=1.05):
    """SAPO (Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347): a smooth gate for PPO's clip.

    r = π/π_old,  τ = tau_pos where A > 0, tau_neg elsewhere,
      f(r) = (4/τ)·σ(τ·(r − 1)),   L = −f(r)·A
    f'(r) = 4·σ(1 − σ): 1 at r = 1 (on-policy, the policy gradient), decaying smoothly as r leaves
    1, faster for larger τ (the paper's τ_neg > τ_pos damps negative updates more). There is no
    hard clip: `clip_low` and `clip_high` must be None. Defaults (τ_pos 1.0, τ_neg 1.05,
    seq-mean-token-mean) are the paper's and TRL's. log r is clamped to ±20.
    metrics: gate_mean (mean of f'(r) = 4σ(1 − σ), the share of each token's gradient kept),
    approx_kl (k3, as in `policy_loss`).
    """
    if clip_low is not None or clip_high is not None:
        raise ValueError(f"sapo has no hard clip (its gate is soft): clip_low and clip_high must be None, "
                         f"got {clip_low}, {clip_high}")
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio, m = _log_ratio(logp, old_logp, mask)
    advantages = advantages.detach()
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_ratio.dtype)
    gate = torch.sigmoid(tau * torch.expm1(log_ratio))
    loss_mat = -(4 / tau) * gate * advantages
    metrics = {
        "gate_mean": masked_mean(4 * gate.detach() * (1 - gate.detach()), m).item(),
        "approx_kl": _k3_from_log_ratio(log_ratio.detach(), m),
    }
    return aggregate_loss(_weighted(loss_mat, is_weights), m, agg), metrics


def _weighted(loss_mat, is_weights):
    return loss_mat if is_weights is None else loss_mat * is_weights.detach().to(loss_mat.dtype)


def value_loss(values, old_values, returns, mask, clip=0.5, agg="token-mean"):
    """Clipped value loss (PPO, as in OpenAI baselines / verl):

    v_clip = old_values + clip(values − old_values, −clip, clip)
    L = ½·max((values − R)², (v_clip − R)²);  `clip=None` gives ½·(values − R)².
    metrics: clipfrac (share of tokens where the clipped term is the max).
    """
    m = torch.broadcast_to(mask.bool(), values.shape)
    returns, old_values = returns.detach(), old_values.detach()
    values = torch.where(m, values, 0)  # keep garbage at masked-out positions out of the graph
    loss_mat = (values - returns).square()
    metrics = {"clipfrac": 0.0}
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clip - returns).square()
        metrics["clipfrac"] = masked_mean((clipped > loss_mat).float(), m).item()
        loss_mat = torch.maximum(loss_mat, clipped)
    return 0.5 * aggregate_loss(loss_mat, m, agg), metrics

def entropy_from_logits(logits):
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) − Σ softmax(z)·z.

    [..., V] -> [...] in fp32; differentiable. Logits must be finite (no −inf masking). 16-bit
    logits are upcast first: the sum over a large vocabulary loses ~3 digits in bf16.
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def nll_loss(log_probs, mb, entropy=None):
    """The supervised loss, as a worker loss function (Actor.update calls it per micro-batch):
    −mean log p(target token) over the micro-batch's response tokens."""
    return aggregate_loss(-log_probs, mb["response_mask"], "token-mean"), {}
