"""Reward and cost models from preference pairs: the losses, pair accuracy, and the embedded
default's reward / cost model (trained once, cached like the warmed-up policy).

    loss_fn = functools.partial(pair_loss, cost=False)     # what RewardModel.update calls
    metrics = rm.update(pair_batch(pairs, pad_id), loss_fn)[0]
    evaluate_pairs(rm, val_pairs, pad_id)                   # {"eval/pair_accuracy": ..., ...}
    path = default_reward_model(cluster, "reward")          # or "cost", with its data source

Pairs come from hflow.data.preference (rows 2i / 2i+1 of a batch are pair i's chosen /
rejected response; chosen is the better one, for a cost model the safer one).
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from hflow.data import PromptSampler
from hflow.data.preference import PairDataConfig, builtin_pair_rows, pair_batch, tokenize_pairs
from hflow.default_model import default_policy, default_policy_dir
from hflow.workers.fsdp import OptimConfig
from hflow.workers.reward import RewardModel, RewardModelConfig

# Bump whenever anything changes what default_reward_model builds (its data, settings, or code that
# changes its numbers): the cached directory carries it, so an old cache is not silently reused.
REWARD_MODEL_VERSION = 1


# ---------------------------------------------------------------- losses and metrics

def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """L = −mean_i log σ(r_i^chosen − r_i^rejected): the negative log-likelihood of the
    preferences under Bradley–Terry, P(chosen ≻ rejected) = σ(r^chosen − r^rejected)."""
    return -F.logsigmoid(chosen - rejected).mean()


def cost_model_loss(safer: torch.Tensor, unsafer: torch.Tensor, safer_is_safe: torch.Tensor,
                    unsafer_is_safe: torch.Tensor) -> torch.Tensor:
    """Safe-RLHF's cost model loss (Dai et al. 2023, eq. 6), per pair i:

        L_i = −log σ(c_i^unsafer − c_i^safer) − log σ(s_i^safer·c_i^safer) − log σ(s_i^unsafer·c_i^unsafer)

    with s = +1 for an unsafe response and −1 for a safe one; L = mean_i L_i. The first term
    ranks (the less safe response costs more), the other two classify: cost > 0 ⇔ unsafe."""
    sign = lambda is_safe: 1.0 - 2.0 * is_safe.float()   # noqa: E731  (safe -> -1, unsafe -> +1)
    return (-F.logsigmoid(unsafer - safer) - F.logsigmoid(sign(safer_is_safe) * safer)
            - F.logsigmoid(sign(unsafer_is_safe) * unsafer)).mean()


def pair_metrics(scores: torch.Tensor, safe: torch.Tensor | None = None, cost: bool = False) -> dict[str, float]:
    """Metrics of scores [2B] in pair layout (rows 2i chosen, 2i+1 rejected).

    accuracy: share of pairs ranked right, r^chosen > r^rejected (a cost model: c^chosen <
    c^rejected, the safer one costs less; a tie counts as wrong); margin: the mean of that
    difference. A cost model also gets sign_accuracy: share of responses with cost > 0 ⇔ unsafe."""
    chosen, rejected = scores[0::2].float(), scores[1::2].float()
    margin = chosen - rejected if not cost else rejected - chosen
    metrics = {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}
    if cost and safe is not None:
        metrics["sign_accuracy"] = ((scores > 0) == (safe < 0.5)).float().mean().item()
    return metrics


def pair_loss(scores: torch.Tensor, mb, *, cost: bool = False):
    """The loss RewardModel.update minimises on a micro-batch of pairs: Bradley–Terry, or the
    cost model's ranking + sign terms (`cost`, which needs the batch's `safe` labels)."""
    chosen, rejected = scores[0::2], scores[1::2]
    if not bool((mb["chosen"][0::2] == 1).all() and (mb["chosen"][1::2] == 0).all()):
        raise ValueError("a micro-batch is not in pair layout (rows 2i chosen, 2i+1 rejected)")
    if cost:
        if "safe" not in mb:
            raise ValueError("a cost model trains on pairs with safety labels: give "
                             "--data.chosen-safe-key and --data.rejected-safe-key")
        loss = cost_model_loss(chosen, rejected, mb["safe"][0::2], mb["safe"][1::2])
    else:
        loss = bradley_terry_loss(chosen, rejected)
    return loss, pair_metrics(scores.detach(), mb["safe"] if "safe" in mb else None, cost)


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


# ---------------------------------------------------------------- the embedded default's models

def default_reward_model_dir(kind: str = "reward", rows: Callable | None = None, size: str = "default",
                             seed: int = 0, cache_dir=None) -> Path:
    """Where `default_reward_model` caches its model (nothing is built here)."""
    rows = rows or builtin_pair_rows(kind)
    policy = default_policy_dir(size, seed, cache_dir=cache_dir)
    return policy.with_name(f"{policy.name}-{kind}-{rows.__name__}-r{REWARD_MODEL_VERSION}")


def default_reward_model(cluster, kind: str = "reward", rows: Callable[[str, int], list[dict]] | None = None,
                         size: str = "default", seed: int = 0, steps: int = 600, cache_dir=None) -> Path:
    """The embedded default's reward model (kind "reward") or cost model ("cost"), trained once
    and cached next to the warmed-up policy it starts from (its backbone, a new score head).

    `rows(split, seed)` gives the pairs (default: `hflow.data.preference.builtin_pair_rows(kind)`:
    the arithmetic pairs, or the safety task's for a cost model). Trained on the controller's
    whole cluster (`steps` steps of 64 pairs), then exported; the directory appears complete
    or not at all (written under a temporary name, renamed)."""
    rows = rows or builtin_pair_rows(kind)
    final = default_reward_model_dir(kind, rows, size, seed, cache_dir)
    if (final / "config.json").exists():
        return final
    policy = default_policy(cluster, size, seed, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    data = PairDataConfig()
    train, val = (tokenize_pairs(rows(split, seed), tokenizer, data) for split in ("train", "val"))
    cost = kind == "cost"
    cfg = RewardModelConfig(model_path=str(policy), trainable=True, micro_batch_size=64,
                            optim=OptimConfig(lr=3e-4, warmup_steps=20))
    rm = cluster.spawn(RewardModel, cfg)
    print(f"training the embedded default's {kind} model on {rows.__name__} (once; cached in {final})", flush=True)
    sampler = PromptSampler(train, data.batch_size, shuffle=True, seed=seed)
    loss_fn = functools.partial(pair_loss, cost=cost)
    for step in range(1, steps + 1):
        metrics = rm.update(pair_batch(next(sampler), tokenizer.pad_token_id), loss_fn)[0]
        if step % 100 == 0 or step == steps:
            held_out = evaluate_pairs(rm, val, tokenizer.pad_token_id, cost)
            print(f"{kind} model step {step}: loss {metrics['rm/loss']:.4f}, train accuracy "
                  f"{metrics['rm/accuracy']:.3f}, held-out " + ", ".join(f"{k} {v:.3f}" for k, v in held_out.items()),
                  flush=True)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    rm.export_hf(str(tmp), str(policy))
    rm.close()
    try:
        os.rename(tmp, final)
    except OSError:   # another run cached it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            raise
    return final
