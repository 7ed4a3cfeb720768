"""Held-out evaluation: the mean reward of greedy (and sampled) completions.

    metrics = evaluate(actor, val, tokenizer, scorer, cfg.rollout, size=500)
    # {"eval/reward_mean": ..., "eval/reward_mean_sampled": ...}
"""
from __future__ import annotations

import dataclasses

from hflow.data import PromptDataset, iter_batches
from hflow.recipe import prompt_batch, score
from hflow.rewards import Scorer
from hflow.workers import RolloutConfig


def evaluate(actor, dataset: PromptDataset | None, tokenizer, scorer: Scorer, rollout: RolloutConfig,
             size: int, batch_size: int = 512, sampled: bool = True) -> dict[str, float]:
    """Mean reward on the first `size` held-out prompts: greedy (eval/reward_mean) and, unless
    `sampled` is False, one sample at the rollout temperature (eval/reward_mean_sampled)."""
    if dataset is None or size <= 0:
        return {}
    configs = {"eval/reward_mean": dataclasses.replace(rollout, n=1, temperature=0.0, progress=False)}
    if sampled:
        configs["eval/reward_mean_sampled"] = dataclasses.replace(rollout, n=1, progress=False)
    totals = dict.fromkeys(configs, 0.0)
    count = 0
    for rows in iter_batches(dataset, batch_size):
        rows = rows[:size - count]
        prompts = prompt_batch(rows)
        for key, cfg in configs.items():
            scores, _ = score(actor.generate(prompts, cfg), tokenizer, scorer)
            totals[key] += scores.sum().item()
        count += len(rows)
        if count >= size:
            break
    return {key: total / count for key, total in totals.items()}
