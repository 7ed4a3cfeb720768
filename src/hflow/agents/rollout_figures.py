"""What a multi-turn rollout's batch says, read from its columns on the controller (over every
rank's rows): its figures, and which trajectories failed for want of a working environment."""
from __future__ import annotations

from collections import Counter
from typing import Optional

from hflow.agents.trajectory import REWARD_FN_FAILED, failure_counts, failure_of
from hflow.batch import Batch


def environment_failures(batch: Batch) -> list[Optional[str]]:
    """Per trajectory, None or why its environment reward is 0 for want of a working environment
    (trajectory.failure_of), in words: the failure that ended it (`finish reason: error`), or the
    reward function failing on its final answer. A trajectory that ran out of turns or tokens did
    not fail: its 0 is the policy's."""
    rows = zip(batch["finish_reason"], batch["agent_error"], batch["failed"].tolist(), batch["reward_errors"].tolist())
    return [_in_words(failure_of(reason, failed, errors), error) for reason, error, failed, errors in rows]


def _in_words(failure: Optional[str], error: str) -> Optional[str]:
    if failure == REWARD_FN_FAILED:
        return "the reward function failed on its final answer"
    return None if failure is None else f"{failure}: {error}"


def agent_rollout_metrics(batch: Batch, prefix: str = "agent/") -> dict[str, float]:
    """A rollout's figures from its columns (so on the controller, over every rank's rows):
    turns, model vs observation tokens, tool calls, failures, how trajectories ended (a fraction
    each), how many failed each way (failures/<reason>, counts: trajectory.failure_counts), and
    the share of turn prompts the prefix cache supplied."""
    n = len(batch)
    real = batch["attention_mask"][:, -batch["response_mask"].shape[1]:].float()
    model = batch["response_mask"].float().sum(1)
    metrics = {
        f"{prefix}turns": batch["turns"].float().mean().item(),
        f"{prefix}model_tokens": model.mean().item(),
        f"{prefix}observation_tokens": (real.sum(1) - model).mean().item(),
        f"{prefix}tool_calls": batch["tool_calls"].float().mean().item(),
        f"{prefix}bad_tool_calls": batch["bad_tool_calls"].float().mean().item(),
        f"{prefix}failed": batch["failed"].float().mean().item(),
        f"{prefix}trajectory_reward": batch["trajectory_reward"].mean().item(),
    }
    total = int(batch["prompt_tokens"].sum())
    if total and "prefill_tokens" in batch:
        metrics[f"{prefix}prefill_reused_fraction"] = 1.0 - int(batch["prefill_tokens"].sum()) / total
    for column in ("prefix_mismatches", "unrecorded_turns"):   # agents served over HTTP (agents.endpoint)
        if column in batch:
            metrics[f"{prefix}{column}"] = batch[column].float().mean().item()
    for reason, k in sorted(Counter(r or "unfinished" for r in batch["finish_reason"]).items()):
        metrics[f"{prefix}finish/{reason}"] = k / n
    metrics.update(failure_counts(map(failure_of, batch["finish_reason"], batch["failed"].tolist(),
                                      batch["reward_errors"].tolist()), prefix))
    return metrics
