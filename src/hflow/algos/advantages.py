"""Advantage estimators, and the registry a recipe picks one from by name.

Each estimator is a pure function on [B, R] tensors that runs without autograd. The registry
(`ESTIMATORS`, as verl's `register_adv_est`) holds the critic-free ones recipes/grpo.py offers,
each behind one signature:

    fn(token_rewards [B, R], mask [B, R], groups [B], *, gamma) -> advantages [B, R]

with the score on each response's last token (minus beta * KL on every token when the KL is in
the reward) and `groups` the prompt each row answers. GAE (with a critic) and ReMax (with a
greedy baseline) take other inputs and are called directly.
"""
import torch

from hflow.algos.masked import masked_whiten
from hflow.algos.registry import Registry

ESTIMATORS = Registry("advantage estimator")
# fn(token_rewards, mask, groups, *, gamma) -> advantages, added as `name`
register_estimator = ESTIMATORS.register
estimator = ESTIMATORS.find


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


# ---- the registry: one reward per response is the sum of its token rewards (the score, minus
# beta * sum_t KL_t when the KL is in the reward); reinforce_pp keeps them per token

@register_estimator("grpo")
def _grpo(token_rewards, mask, groups, *, gamma=1.0):
    return grpo_advantages(token_rewards.sum(-1), groups, mask, norm_by_std=True)


@register_estimator("drgrpo")
def _drgrpo(token_rewards, mask, groups, *, gamma=1.0):
    return grpo_advantages(token_rewards.sum(-1), groups, mask, norm_by_std=False)


@register_estimator("rloo")
def _rloo(token_rewards, mask, groups, *, gamma=1.0):
    return rloo_advantages(token_rewards.sum(-1), groups, mask)


@register_estimator("reinforce_pp")
def _reinforce_pp(token_rewards, mask, groups, *, gamma=1.0):
    return reinforce_pp_advantages(token_rewards, mask, gamma)


@register_estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(token_rewards, mask, groups, *, gamma=1.0):
    return reinforce_pp_baseline_advantages(token_rewards.sum(-1), groups, mask)
