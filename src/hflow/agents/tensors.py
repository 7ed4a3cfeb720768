"""Trajectories into the batch layout of hflow.layout, observation tokens masked out, and the
columns that say how each went."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from hflow.agents.trajectory import Trajectory
from hflow.layout import sequence_tensors


def trajectory_tensors(trajectories: Sequence[Trajectory], pad_id: int, response_len: Optional[int] = None,
                       prompt_len: Optional[int] = None) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, responses, response_mask and rollout_log_probs: the layout's
    tensors with response_mask 1 only on the model's own tokens (observation tokens are attended
    to but neither trained on nor scored by a log-prob) and rollout_log_probs 0 under them; and
    turn_index [B, R] long: the model turn (0, 1, ...) each response token belongs to, -1 on
    observation tokens and padding (per-turn credit reads it beside trajectory_columns'
    turn_rewards)."""
    for i, t in enumerate(trajectories):
        if not t.prompt_ids:
            raise ValueError(f"trajectory {i} has no prompt (it failed at reset: {t.finish_reason}, {t.error}); "
                             "leave it out of the batch")
    out = sequence_tensors([t.prompt_ids for t in trajectories], [t.response_ids() for t in trajectories], pad_id,
                           response_len=response_len, prompt_len=prompt_len,
                           response_logprobs=[t.rollout_logprobs() for t in trajectories])
    mask = torch.zeros_like(out["response_mask"])
    turn_index = torch.full(mask.shape, -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        row = t.response_mask()
        mask[i, :len(row)] = torch.tensor(row, dtype=mask.dtype)
        turn_index[i, :len(row)] = torch.tensor(turn_indices(t), dtype=torch.long)
    out["response_mask"] = mask
    out["turn_index"] = turn_index
    return out


def turn_indices(trajectory: Trajectory) -> list[int]:
    """Aligned with response_ids(): the model turn each token belongs to, -1 under observations."""
    out, turn = [], 0
    for s in trajectory.segments:
        out += [turn if s.from_model else -1] * len(s.token_ids)
        turn += s.from_model
    return out


def turn_rewards(trajectory: Trajectory) -> list[float]:
    """One reward per model turn: the environment's, 0 for a turn it never answered (the last,
    cut short by a token limit), and 0 for every turn of a failed trajectory (its rule: a broken
    tool or environment is no evidence about the policy)."""
    rewards = [] if trajectory.failed else list(trajectory.turn_rewards)
    return [float(r) for r in rewards[:trajectory.num_turns]] + [0.0] * (trajectory.num_turns - len(rewards))


def trajectory_rewards(trajectories: Sequence[Trajectory], discount: float = 1.0) -> torch.Tensor:
    """[B] float32: each trajectory's reward (its turns' rewards, discounted; 0 for a failure)."""
    return torch.tensor([t.reward(discount) for t in trajectories], dtype=torch.float32)


def trajectory_columns(trajectories: Sequence[Trajectory]) -> dict:
    """Per trajectory, what a rollout batch says besides its tokens (rollout_figures reads them):
    how it ended, its reward, its turns and counted events; turn_rewards, its reward per model
    turn (turn_rewards'), a list per row rather than a tensor: the rows of different ranks have
    different most turns, and a tensor column needs one width to be concatenated
    (hflow.algos.pad_turn_rewards pads them on the controller)."""
    def count(key: str) -> torch.Tensor:
        return torch.tensor([t.counts.get(key, 0) for t in trajectories], dtype=torch.long)
    return {
        "finish_reason": [t.finish_reason for t in trajectories],
        "agent_error": [t.error for t in trajectories],
        "model_text": [t.model_text() for t in trajectories],
        "trajectory_reward": trajectory_rewards(trajectories),
        "turn_rewards": [turn_rewards(t) for t in trajectories],
        "turns": torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
        "failed": torch.tensor([t.failed for t in trajectories], dtype=torch.bool),
        "tool_calls": count("tool_calls"),
        "bad_tool_calls": count("bad_tool_calls"),
        # final answers whose reward function failed (a built-in's --reward.fn): scored 0, not failed
        "reward_errors": count("reward_errors"),
    }
