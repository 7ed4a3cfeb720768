"""The math of RL on language models: advantages, losses, KL estimators and controllers.

Pure functions on `[batch, response_len]` tensors with a 0/1 response `mask` (1 = a token the
policy generated and is trained on; 0 = padding, or tool/environment output inside a multi-turn
response). Conventions shared by every function here:

- Masked-out positions never influence a result, even if they hold NaN or inf: values there are
  selected away with `torch.where` (not multiplied by 0, which would keep a NaN), and outputs are
  0 there. Gradients at masked-out positions are exactly 0.
- A mean over nothing (an all-zero mask) is 0, so an all-padding micro-batch adds nothing
  instead of a NaN.
- Advantage estimators run without autograd and return detached tensors.
- Losses return `(loss, metrics)`: `loss` a 0-dim tensor carrying the gradient, `metrics` a dict
  of plain Python floats (ready for logging; on GPU `.item()` costs one device sync per call).
- `gamma`, `lam`, clip ranges and coefficients are Python floats.

verl's `trainer/ppo/core_algos.py` is the model for names and formulas; this is our own code.
"""
import torch

__all__ = [
    "masked_mean", "masked_whiten", "aggregate_loss", "scores_to_token_rewards",
    "gae_advantages", "grpo_advantages", "rloo_advantages", "remax_advantages",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "groups_with_varied_scores",
    "overlong_penalty", "kl_penalty", "policy_loss", "gspo_policy_loss", "value_loss",
    "entropy_from_logits", "FixedKLController", "AdaptiveKLController", "AGG_MODES",
    "KL_KINDS", "explained_variance",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3", "abs", "low_var_kl")
_WHITEN_EPS = 1e-8
# exp() of a log-ratio beyond ±20 overflows to nonsense long before it is informative
_MAX_LOG_RATIO = 20.0


# ---------------------------------------------------------------------------------------------
# masked reductions


def masked_mean(x, mask, dim=None):
    """mean of x over the positions where mask = 1: sum(x·m) / sum(m)  (0 where sum(m) = 0).

    `dim=None` reduces everything to a 0-dim tensor; an int or tuple reduces those dims only.
    """
    m = torch.broadcast_to(mask.bool(), x.shape)
    total = torch.where(m, x, 0).sum(dim=dim)
    return total / m.sum(dim=dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """(x − μ) / sqrt(σ² + 1e-8) over the masked-in positions; 0 at masked-out positions.

    μ and σ² are the masked mean and the unbiased masked variance (Σ(x−μ)²·m / (n − 1)).
    `shift_mean=False` adds μ back: the scale is normalised, the mean kept.
    """
    m = torch.broadcast_to(mask.bool(), x.shape)
    mean = masked_mean(x, m)
    centered = torch.where(m, x - mean, 0)
    var = centered.square().sum() / (m.sum() - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0)


def aggregate_loss(loss_mat, mask, agg="token-mean"):
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean:          Σ_bt L·m / Σ_bt m           (every token weighs the same; DAPO)
    seq-mean-token-sum:  (1/B) Σ_b Σ_t L·m          (Dr.GRPO-like: no length normalisation)
    seq-mean-token-mean: (1/B) Σ_b (Σ_t L·m / Σ_t m) (every sequence weighs the same; GRPO paper)
    A sequence with no masked-in token contributes 0 and still counts in B.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    m = torch.broadcast_to(mask.bool(), loss_mat.shape)
    per_token = torch.where(m, loss_mat, 0)
    if agg == "seq-mean-token-sum":
        return per_token.sum(-1).mean()
    if agg == "seq-mean-token-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGG_MODES}")


# ---------------------------------------------------------------------------------------------
# advantage estimators


def scores_to_token_rewards(scores, mask):
    """Place each sequence's scalar score on its last masked-in token: r[b, last_b] = score_b.

    The usual outcome reward for GAE / REINFORCE++ (then subtract β·KL per token if wanted).
    """
    m = mask.bool()
    scores = _as_scores(scores, m)
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & m  # the last 1 of each row
    return torch.where(last, scores[:, None], 0)


@torch.no_grad()
def _discounted_over_mask(token_rewards, values, mask, gamma, lam):
    """GAE's backward recursion run over the masked-in tokens only (the others are skipped).

    For consecutive masked-in positions t < t' (anything masked-out between them ignored):
      δ_t = r_t + γ·V_t' − V_t,   A_t = δ_t + γλ·A_t'   (V and A past the last token are 0).
    """
    m = mask.bool()
    advantages = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    next_adv = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        on = m[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # where, not multiply: a NaN at a masked-out position must not leak in
        advantages[:, t] = torch.where(on, adv, 0)
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv, next_adv)
    return advantages


@torch.no_grad()
def gae_advantages(token_rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016), raw (not whitened).

    δ_t = r_t + γ·V_{t+1} − V_t,  A_t = δ_t + γλ·A_{t+1},  returns_t = A_t + V_t,
    where "t+1" is the next *masked-in* token: positions with mask 0 inside a response (tool
    output in a multi-turn rollout) are skipped, so their rewards and values change nothing.
    Returns (advantages, returns), both [B, T], 0 at masked-out positions.
    """
    m = mask.bool()
    advantages = _discounted_over_mask(token_rewards, values, m, gamma, lam)
    returns = torch.where(m, advantages + values, 0)
    return advantages, returns


def grpo_advantages(scores, group_ids, mask, norm_by_std=True, eps=1e-6):
    """GRPO (Shao et al. 2024): A_i = (s_i − mean_g) / (std_g + eps), broadcast to the tokens.

    mean_g and std_g are over the samples of i's group (std unbiased, as `torch.std`).
    `norm_by_std=False` gives Dr.GRPO (Liu et al. 2025): A_i = s_i − mean_g.
    A group of one sample has no baseline (std undefined): its advantage is 0.
    `group_ids`: a tensor of ints or any list of hashables (e.g. prompt uids), one per row.
    Returns advantages [B, T] (0 at masked-out positions).
    """
    m = mask.bool()
    scores = _as_scores(scores, m)
    _, mean, std = _group_stats(scores, group_ids)
    adv = scores - mean  # exactly 0 for a group of one
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(m, adv[:, None], 0)


def rloo_advantages(scores, group_ids, mask):
    """RLOO (Ahmadian et al. 2024): A_i = s_i − mean_{j≠i in group} s_j = n/(n−1)·(s_i − mean_g).

    A group of one sample has no other sample to compare with: its advantage is 0.
    Returns advantages [B, T] (0 at masked-out positions).
    """
    m = mask.bool()
    scores = _as_scores(scores, m)
    count, mean, _ = _group_stats(scores, group_ids)
    adv = (scores - mean) * count / (count - 1).clamp(min=1)  # exactly 0 for a group of one
    return torch.where(m, adv[:, None], 0)


def remax_advantages(scores, baseline_scores, mask):
    """ReMax (Li et al. 2023): A_i = s_i − b_i, b_i the score of the greedy response to the same
    prompt, broadcast to the tokens. Returns advantages [B, T] (0 at masked-out positions)."""
    m = mask.bool()
    adv = _as_scores(scores, m) - _as_scores(baseline_scores, m)
    return torch.where(m, adv[:, None], 0)


def reinforce_pp_advantages(token_rewards, mask, gamma=1.0):
    """REINFORCE++ (Hu 2025): A = whiten(G) over all masked-in tokens of the batch, where
    G_t = r_t + γ·G_{t+1} is the return-to-go over the masked-in tokens (others skipped).
    The token rewards carry the KL: r_t = 1[t = last]·score − β·KL_t. Whitening is global (the
    batch's masked mean and unbiased variance, as `masked_whiten`), never per group.
    Returns advantages [B, T] (0 at masked-out positions)."""
    m = mask.bool()
    returns = _discounted_over_mask(token_rewards, torch.zeros_like(token_rewards), m, gamma, 1.0)
    return masked_whiten(returns, m)


def reinforce_pp_baseline_advantages(scores, group_ids, mask):
    """REINFORCE++-baseline (Hu 2025): the group mean subtracted, then whitened over the batch:

    a_i = s_i − mean_g (no division by the group's std),  A = whiten(a) over all masked-in
    tokens of the batch (every token of response i holds a_i, so long responses weigh more in
    the mean and variance, as verl and OpenRLHF). s_i is the sequence's reward (its score, minus
    β·Σ_t KL_t when the KL is in the reward). A group of one has a_i = 0.
    Returns advantages [B, T] (0 at masked-out positions).
    """
    m = mask.bool()
    scores = _as_scores(scores, m)
    _, mean, _ = _group_stats(scores, group_ids)
    return masked_whiten(torch.where(m, (scores - mean)[:, None], 0), m)


def groups_with_varied_scores(scores, group_ids):
    """DAPO's dynamic-sampling filter (Yu et al. 2025): True for the rows of every group whose
    scores are not all equal, False for the others (all right, all wrong, or a group of one).

    A group whose scores are all equal has every group-relative advantage 0: it adds no
    gradient, only dilutes the batch. Exact comparison (max_g == min_g), no tolerance.
    Returns a bool tensor [B].
    """
    scores = torch.as_tensor(scores).detach().reshape(-1).double()
    index, n_groups = _group_index(group_ids, scores)
    lowest = scores.new_full((n_groups,), float("inf")).scatter_reduce(0, index, scores, "amin")
    highest = scores.new_full((n_groups,), float("-inf")).scatter_reduce(0, index, scores, "amax")
    return (highest > lowest)[index]


def overlong_penalty(lengths, max_tokens, buffer, factor=1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the score of each response:

    R_len(|y|) = 0                                        if |y| ≤ L_max − L_buf
               = −factor · (|y| − (L_max − L_buf)) / L_buf   if L_max − L_buf < |y| ≤ L_max
               = −factor                                  beyond L_max
    with L_max = `max_tokens` and L_buf = `buffer`: a penalty that grows linearly over the last
    `buffer` tokens before the length cap. `lengths` [B] (response tokens); returns [B] floats.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) must be in (0, max_tokens = {max_tokens}]")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    over = (lengths - (max_tokens - buffer)) / buffer
    return -factor * over.clamp(0.0, 1.0)


def _as_scores(scores, mask):
    """One float per row, on the mask's device; the dtype of floating inputs is kept."""
    scores = torch.as_tensor(scores, device=mask.device)
    if not scores.is_floating_point():
        scores = scores.float()
    scores = scores.detach().reshape(-1)
    if scores.numel() != mask.shape[0]:
        raise ValueError(f"expected one score per row ({mask.shape[0]}), got {scores.numel()}")
    return scores


def _group_index(group_ids, scores):
    """(group number 0..G−1 of each row [B], G) from ids that are ints or any hashables."""
    if isinstance(group_ids, torch.Tensor):
        index = torch.unique(group_ids.reshape(-1), return_inverse=True)[1]
    else:
        first_seen = {}
        index = torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids])
    index = index.to(scores.device)
    if index.numel() != scores.numel():
        raise ValueError(f"expected one group id per row ({scores.numel()}), got {index.numel()}")
    return index, int(index.max()) + 1


def _group_stats(scores, group_ids):
    """Per row: (size, mean, unbiased std) of its group, each a [B] tensor."""
    index, n_groups = _group_index(group_ids, scores)
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count
    sq_dev = zeros.index_add(0, index, (scores - mean[index]).square())
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    return count[index], mean[index], std[index]


# ---------------------------------------------------------------------------------------------
# KL estimators


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


# ---------------------------------------------------------------------------------------------
# losses


def _log_ratio(logp, old_logp, mask):
    """(log π/π_old per token, bool mask): 0 at masked-out positions, clamped to ±20 (a ratio
    beyond e^±20 carries no gradient), no gradient to old_logp."""
    m = torch.broadcast_to(mask.bool(), logp.shape)
    return torch.where(m, logp - old_logp.detach(), 0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), m


def _k3_from_log_ratio(log_ratio, mask):
    """k3 estimate of KL(π_old ‖ π) from samples of π_old: mean of (r − 1) − log r."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item()


def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                agg="token-mean"):
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO's clip-higher and dual-clip.

    r = π/π_old = exp(logp − old_logp),  A = advantages (no gradient to old_logp or A):
      L = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))
      dual-clip (Ye et al. 2020), for A < 0 only:  L = min(L, −A·dual_clip)   (dual_clip > 1)
    aggregated by `aggregate_loss(L, mask, agg)`; log r is clamped to ±20 for stability.
    metrics: clipfrac (share of tokens where the clipped term is the max), approx_kl (k3 estimate
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
    return aggregate_loss(loss_mat, m, agg), metrics


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4,
                     agg="seq-mean-token-mean"):
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
    return aggregate_loss(loss_mat, m, agg), metrics


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


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers (β in r_t = score_t − β·KL_t)


class FixedKLController:
    """β stays `kl_coef`. `update` is a no-op, so recipes can call it unconditionally."""

    def __init__(self, kl_coef):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"):

    err = clip(KL / target − 1, −0.2, 0.2),  β ← β·(1 + err·n_steps / horizon)
    where KL is the measured mean KL of the last batch and n_steps its number of samples.
    """

    def __init__(self, init_kl_coef, target_kl, horizon):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self):
        # only β is state; target and horizon are configuration and come from the flags
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])



# ---------------------------------------------------------------------------------------------
# critic diagnostics


@torch.no_grad()
def explained_variance(values, returns, mask):
    """How much of the returns' spread the values predict (verl's critic/vf_explained_var):

    EV = 1 − Var(R − V) / Var(R)   over the masked-in tokens.
    1: V predicts R exactly; 0: no better than a constant; < 0: worse than one. A constant
    offset in V costs nothing (it is a variance of the error, not its mean square). Where the
    returns do not vary at all, EV is 1 if the error does not vary either, else 0 (as
    scikit-learn's explained_variance_score), not a division by 0. A Python float.
    """
    m = torch.broadcast_to(mask.bool(), returns.shape)

    def variance(x):   # the biased masked variance: the (n − 1) / n factors would cancel in the ratio
        return masked_mean((x - masked_mean(x, m)).square(), m)

    var_returns, var_error = variance(returns), variance(returns - values)
    if var_returns == 0:
        return 1.0 if var_error == 0 else 0.0
    return (1 - var_error / var_returns).item()
