"""Trajectories into the batch layout of hflow.layout, observation tokens masked out."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from hflow.agents.trajectory import Trajectory
from hflow.layout import sequence_tensors


def trajectory_tensors(trajectories: Sequence[Trajectory], pad_id: int, response_len: Optional[int] = None,
                       prompt_len: Optional[int] = None) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, responses, response_mask and rollout_log_probs: the layout's
    tensors with response_mask 1 only on the model's own tokens (observation tokens are attended
    to but neither trained on nor scored by a log-prob) and rollout_log_probs 0 under them."""
    for i, t in enumerate(trajectories):
        if not t.prompt_ids:
            raise ValueError(f"trajectory {i} has no prompt (it failed at reset: {t.finish_reason}, {t.error}); "
                             "leave it out of the batch")
    out = sequence_tensors([t.prompt_ids for t in trajectories], [t.response_ids() for t in trajectories], pad_id,
                           response_len=response_len, prompt_len=prompt_len,
                           response_logprobs=[t.rollout_logprobs() for t in trajectories])
    mask = torch.zeros_like(out["response_mask"])
    for i, t in enumerate(trajectories):
        row = t.response_mask()
        mask[i, :len(row)] = torch.tensor(row, dtype=mask.dtype)
    out["response_mask"] = mask
    return out


def trajectory_rewards(trajectories: Sequence[Trajectory], discount: float = 1.0) -> torch.Tensor:
    """[B] float32: each trajectory's reward (its turns' rewards, discounted; 0 for a failure)."""
    return torch.tensor([t.reward(discount) for t in trajectories], dtype=torch.float32)
