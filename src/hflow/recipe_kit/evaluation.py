"""Held-out evaluation: the mean reward of greedy (and sampled) responses, the task's own
figures, and a reward model's pair accuracy. Single-turn completions scored by the rule unless
the caller says how to respond (recipes/agent.py: multi-turn trajectories, its own scores).

    metrics = evaluate(actor, val, tokenizer, rewards.rule, cfg.rollout, size=500)
    # {"eval/reward_mean": ..., "eval/reward_mean_sampled": ...}
    metrics = evaluate_pairs(rm, val_pairs, pad_id)   # {"eval/pair_accuracy": ..., "eval/pair_margin": ...}
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hflow.algos import pair_metrics
from hflow.batch import Batch
from hflow.data import PromptDataset, iter_batches
from hflow.data.preference import pair_batch
from hflow.rewards import Scorer
from hflow.recipe_kit.scoring import score
from hflow.recipe_kit.text_batches import prompt_batch, response_texts
from hflow.workers import RolloutConfig

# (prompt texts, response texts, ground truths) -> {name: value}, logged as eval/<name>
TaskMetrics = Callable[[list[str], list[str], list], dict[str, float]]
# (held-out prompts, how to generate) -> the responses and the sum of their scores
Respond = Callable[[list, RolloutConfig], tuple[Batch, float]]
# a batch of greedy responses -> its figures, means over its rows, logged as named
BatchFigures = Callable[[Batch], dict[str, float]]


def single_turn(actor, tokenizer, rule: Scorer) -> Respond:
    """One completion per prompt from `actor`, scored by the rule."""
    def respond(rows, cfg):
        responses = actor.generate(prompt_batch(rows), cfg)
        return responses, score(responses, tokenizer, rule)[0].sum().item()
    return respond


def evaluate(actor, dataset: PromptDataset | None, tokenizer, rule: Scorer, rollout: RolloutConfig,
             size: int, batch_size: int = 512, sampled: bool = True, task_metrics: TaskMetrics | None = None,
             respond: Respond | None = None, batch_figures: BatchFigures | None = None) -> dict[str, float]:
    """Mean reward on the first `size` held-out prompts: greedy (eval/reward_mean) and, unless
    `sampled` is False, one sample at the rollout temperature (eval/reward_mean_sampled). The
    responses and the sum of their scores come from `respond` (default: `single_turn`); with `task_metrics`,
    the task's own figures of the greedy responses as eval/<name>; with `batch_figures`, the
    figures of each batch of greedy responses, averaged over the prompts."""
    if dataset is None or size <= 0:
        return {}
    respond = respond or single_turn(actor, tokenizer, rule)
    configs = {"eval/reward_mean": dataclasses.replace(rollout, n=1, temperature=0.0, progress=False)}
    if sampled:
        configs["eval/reward_mean_sampled"] = dataclasses.replace(rollout, n=1, progress=False)
    totals = dict.fromkeys(configs, 0.0)
    prompts, greedy_texts, answers = [], [], []
    for rows in iter_batches(dataset, batch_size):
        rows = rows[:size - len(prompts)]
        for key, cfg in configs.items():
            responses, total = respond(rows, cfg)
            totals[key] += total
            if key == "eval/reward_mean" and task_metrics is not None:
                greedy_texts += response_texts(responses, tokenizer)
            if key == "eval/reward_mean" and batch_figures is not None:
                for name, value in batch_figures(responses).items():   # weighted by rows: the last batch may be short
                    totals[name] = totals.get(name, 0.0) + value * len(rows)
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
