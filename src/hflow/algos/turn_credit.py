"""Per-turn credit for multi-turn trajectories: each turn's reward on its own turn's tokens.

An environment rewards every model turn it answers (r_{i,t} for trajectory i, turn t). Outcome
credit sums them into one score on the last token; here each turn is credited with what follows
it, against the other trajectories of the same prompt at the same turn (step-wise, GiGPO's idea,
Feng et al. 2025, with the turn index standing for its anchor state):

    G_{i,t}     = sum_{t' >= t} gamma^(t'-t) * r_{i,t'}        (the turn's discounted return-to-go)
    A^step_{i,t} = (G_{i,t} - mean_S G) / (std_S G + eps)        S = {j in i's group with a turn t}
    A^ep_i      = (G_{i,0} - mean_g G_{.,0}) / (std_g + eps)     g = i's group (GRPO on the score)
    A_{i,t}     = A^step_{i,t} + episode_weight * A^ep_i        on every token of turn t

std unbiased (as torch.std); `norm_by_std=False` leaves the division out (Dr.GRPO's, GiGPO's
mean_norm). A step group or prompt group of one has no baseline: its term is 0. GiGPO's
A^ep + omega * A^step is omega * (A^step + A^ep / omega): episode_weight = 1/omega, up to scale.
"""
import torch

from hflow.algos.advantages import _group_stats


def pad_turn_rewards(rows):
    """Per-row lists of per-turn rewards (a rollout batch's turn_rewards column) as (rewards
    [B, T] float32, valid [B, T] bool), T the most turns of any row (at least 1), padded with
    invalid zeros."""
    T = max([len(r) for r in rows] + [1])
    rewards, valid = torch.zeros(len(rows), T), torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        rewards[i, :len(r)] = torch.tensor([float(x) for x in r], dtype=torch.float32)
        valid[i, :len(r)] = True
    return rewards, valid


@torch.no_grad()
def turn_returns(turn_rewards, turn_valid, gamma=1.0):
    """G_t = r_t + gamma * G_{t+1} over each row's valid turns ([B, T] each; turns past a row's
    last valid one add nothing). Returns [B, T] float, 0 at invalid turns."""
    valid = turn_valid.bool()
    rewards = torch.where(valid, turn_rewards.float(), 0.0)
    returns = torch.zeros_like(rewards)
    following = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        following = rewards[:, t] + gamma * following
        returns[:, t] = torch.where(valid[:, t], following, 0.0)
    return returns


@torch.no_grad()
def turn_advantages(turn_index, turn_rewards, turn_valid, mask, groups, *, gamma=1.0, episode_weight=0.0,
                    norm_by_std=True, eps=1e-6):
    """The module docstring's A_{i,t} on each token: `turn_index` [B, R] long (the model turn a
    response token belongs to, -1 elsewhere), `turn_rewards` / `turn_valid` [B, T] (valid: the
    turn exists), `mask` [B, R] (the response mask: only its tokens get an advantage), `groups`
    [B] (the prompt each row answers: ints or hashables). Returns [B, R] float, 0 off the mask."""
    B, T = turn_rewards.shape
    m = mask.bool()
    if T == 0:   # no row has a turn: one column that no token belongs to
        turn_rewards, turn_valid, T = turn_rewards.new_zeros(B, 1), turn_valid.new_zeros(B, 1), 1
    if turn_index.shape != mask.shape or turn_valid.shape != (B, T) or m.shape[0] != B:
        raise ValueError(f"shapes disagree: turn_index {tuple(turn_index.shape)}, mask {tuple(mask.shape)}, "
                         f"turn_rewards {(B, T)}, turn_valid {tuple(turn_valid.shape)}")
    valid = turn_valid.bool()
    returns = turn_returns(turn_rewards, valid, gamma)
    # the step-wise groups: (prompt group, turn), counted over the turns that exist
    rows, turns = valid.nonzero(as_tuple=True)
    group_index = _group_index_of(groups, B)
    step = torch.zeros_like(returns)
    if len(rows):
        g = returns[rows, turns].double()
        count, mean, std = _group_stats(g, (group_index[rows] * T + turns).tolist())
        adv = g - mean
        if norm_by_std:
            adv = adv / (std + eps)
        step[rows, turns] = torch.where(count > 1, adv, 0.0).to(step.dtype)
    count, mean, std = _group_stats(returns[:, 0].double(), group_index.tolist())
    episode = returns[:, 0].double() - mean
    if norm_by_std:
        episode = episode / (std + eps)
    episode = torch.where(count > 1, episode, 0.0).to(step.dtype)
    per_turn = step + episode_weight * episode[:, None]
    index = turn_index.to(torch.long)
    rows_on, index_on = m.nonzero(as_tuple=True)[0], index[m]
    if ((index_on < 0) | (index_on >= T)).any() or not valid[rows_on, index_on.clamp(0, T - 1)].all():
        raise ValueError("a response token belongs to no turn that has a reward (turn_index, turn_valid and "
                         "the mask disagree)")
    token = per_turn.gather(1, index.clamp(0, T - 1))
    return torch.where(m, token, 0.0)


def _group_index_of(groups, rows: int) -> torch.Tensor:
    """Each row's group as a number 0..G-1 (from ints or any hashables)."""
    if isinstance(groups, torch.Tensor):
        index = torch.unique(groups.reshape(-1), return_inverse=True)[1]
    else:
        seen = {}
        index = torch.tensor([seen.setdefault(g, len(seen)) for g in groups], dtype=torch.long)
    if index.numel() != rows:
        raise ValueError(f"expected one group id per row ({rows}), got {index.numel()}")
    return index
