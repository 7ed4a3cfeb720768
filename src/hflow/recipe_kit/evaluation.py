"""Held-out evaluation: the mean rule reward of greedy (and sampled) completions, the task's own
figures, and a reward model's pair accuracy.

    metrics = evaluate(actor, val, tokenizer, rewards.rule, cfg.rollout, size=500)
    # {"eval/reward_mean": ..., "eval/reward_mean_sampled": ...}
    metrics = evaluate_pairs(rm, val_pairs, pad_id)   # {"eval/pair_accuracy": ..., "eval/pair_margin": ...}
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hflow.algos import pair_metrics
from hflow.data import PromptDataset, iter_batches
from hflow.data.preference import pair_batch
from hflow.rewards import Scorer
from hflow.recipe_kit.scoring import score
from hflow.recipe_kit.text_batches import prompt_batch, response_texts
from hflow.workers import RolloutConfig

# (prompt texts, response texts, ground truths) -> {name: value}, logged as eval/<name>
TaskMetrics = Callable[[list[str], list[str], list], dict[str, float]]


def evaluate(actor, dataset: PromptDataset | None, tokenizer, rule: Scorer, rollout: RolloutConfig,
             size: int, batch_size: int = 512, sampled: bool = True,
             task_metrics: TaskMetrics | None = None) -> dict[str, float]:
    """Mean rule reward on the first `size` held-out prompts: greedy (eval/reward_mean) and,
    unless `sampled` is False, one sample at the rollout temperature (eval/reward_mean_sampled);
    with `task_metrics`, the task's own figures of the greedy responses as eval/<name>."""
    if dataset is None or size <= 0:
        return {}
    configs = {"eval/reward_mean": dataclasses.replace(rollout, n=1, temperature=0.0, progress=False)}
    if sampled:
        configs["eval/reward_mean_sampled"] = dataclasses.replace(rollout, n=1, progress=False)
    totals = dict.fromkeys(configs, 0.0)
    prompts, greedy_texts, answers = [], [], []
    for rows in iter_batches(dataset, batch_size):
        rows = rows[:size - len(prompts)]
        batch = prompt_batch(rows)
        for key, cfg in configs.items():
            responses = actor.generate(batch, cfg)
            scores, _ = score(responses, tokenizer, rule)
            totals[key] += scores.sum().item()
            if key == "eval/reward_mean" and task_metrics is not None:
                greedy_texts += response_texts(responses, tokenizer)
        prompts += [p.prompt for p in rows]
        answers += [p.ground_truth for p in rows]
        if len(prompts) >= size:
            break
    metrics = {key: total / len(prompts) for key, total in totals.items()}
    if task_metrics is not None:
        metrics |= {f"eval/{k}": v for k, v in task_metrics(prompts, greedy_texts, answers).items()}
    return metrics


def evaluate_pairs(rm, pairs: list[tuple], pad_id: int, cost: bool = False, batch_size: int = 512) -> dict[str, float]:
    """Held-out pair metrics of a RewardModel group: eval/pair_accuracy, eval/pair_margin (and,
    for a cost model, eval/sign_accuracy)."""
    scores, safe = [], []
    for start in range(0, len(pairs), batch_size):
        batch = pair_batch(pairs[start:start + batch_size], pad_id)
        scores.append(rm.scores(batch)["rm_scores"])
        safe.append(batch["safe"] if "safe" in batch else None)
    metrics = pair_metrics(torch.cat(scores), None if safe[0] is None else torch.cat(safe), cost)
    return {f"eval/{'pair_' if k in ('accuracy', 'margin') else ''}{k}": v for k, v in metrics.items()}
