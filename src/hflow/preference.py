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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from hflow.data import DataConfig, PromptSampler, iter_batches, load_prompts
from hflow.data.preference import PairDataConfig, builtin_pair_rows, pair_batch, tokenize_pairs
from hflow.default_model import default_policy, default_policy_dir
from hflow.metrics import progress
from hflow.recipe import prompt_batch, response_texts
from hflow.rewards.arithmetic import arithmetic_score
from hflow.workers import Actor, ActorConfig, OptimConfig, RewardModel, RewardModelConfig, RolloutConfig

# ---------------------------------------------------------------- losses and metrics

def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_coef: float = 0.0) -> torch.Tensor:
    """L = −mean_i log σ(r_i^chosen − r_i^rejected) + λ · mean_i ((r_i^chosen)² + (r_i^rejected)²) / 2

    The first term is the negative log-likelihood of the preferences under Bradley–Terry,
    P(chosen ≻ rejected) = σ(r^chosen − r^rejected). It leaves every prompt a free offset (adding
    c(x) to both scores changes nothing); the centering term (λ = `center_coef`) pulls a pair's
    scores to ±margin / 2, so that 0 means the same on every prompt and an RL critic need not
    learn the offsets (Eisenstein et al. 2023; Safe-RLHF's `regularization`)."""
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_coef:
        loss = loss + center_coef * (chosen.square() + rejected.square()).mean() / 2
    return loss


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


def pair_loss(scores: torch.Tensor, mb, *, cost: bool = False, center_coef: float = 0.0):
    """The loss RewardModel.update minimises on a micro-batch of pairs: Bradley–Terry (+ the
    centering term), or the cost model's ranking + sign terms (`cost`, which needs the batch's
    `safe` labels; its sign term already fixes the zero)."""
    chosen, rejected = scores[0::2], scores[1::2]
    if not bool((mb["chosen"][0::2] == 1).all() and (mb["chosen"][1::2] == 0).all()):
        raise ValueError("a micro-batch is not in pair layout (rows 2i chosen, 2i+1 rejected)")
    if cost:
        if "safe" not in mb:
            raise ValueError("a cost model trains on pairs with safety labels: give "
                             "--data.chosen-safe-key and --data.rejected-safe-key")
        loss = cost_model_loss(chosen, rejected, mb["safe"][0::2], mb["safe"][1::2])
    else:
        loss = bradley_terry_loss(chosen, rejected, center_coef)
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

@dataclass(frozen=True)
class DefaultJudge:
    """How the embedded default's reward or cost model is built."""

    backbone_accuracy: float
    """its backbone: the embedded default supervised to this held-out accuracy (a cached warm-up)"""
    lr: float
    center_coef: float
    """λ of the centering term (bradley_terry_loss)"""
    steps: int
    """optimizer steps of 64 pairs"""
    version: int
    """bump whenever anything changes what gets built: the cached directory carries it"""
    schedule: str = "constant"
    """learning-rate schedule after the warm-up (OptimConfig.schedule; cosine decays to 0 at `steps`)"""
    mistake_samples: int = 0
    """a reward model: samples per training prompt of the warmed-up policy whose mistakes become rejected responses"""
    near_misses: bool = False
    """a reward model: also reject the answer ± 1 and ± 10 on every prompt (hflow.data.preference)"""


DEFAULT_JUDGES = {
    # Started from the policy itself (0.5), a reward model shares the policy's blind spots: on the
    # policy's own samples it ranks the right answer first 53 % of the time, and PPO on it learns
    # wrong answers (held-out 0.53 -> 0.06). So the judge knows more than the student (its backbone
    # is the warm-up continued to 0.95) and is trained on the policy's own mistakes (4 samples a
    # prompt). Without near misses (version 4) PPO still found what it rated right: a carry into
    # the tens added or lost, a units digit off by one (held-out 0.53 -> 0.67); with them the judge
    # ranks a right sample over a wrong one of the same prompt 94 % of the time and PPO reaches
    # 0.82. Worse (version 5): no near misses, 8 samples a prompt, 2500 steps, cosine (0.53 -> 0.46).
    "reward": DefaultJudge(backbone_accuracy=0.95, lr=1e-4, center_coef=0.05, steps=1500, version=6,
                           mistake_samples=4, near_misses=True),
    "cost": DefaultJudge(backbone_accuracy=0.5, lr=3e-4, center_coef=0.0, steps=600, version=1),
}


def policy_mistakes(cluster, policy, split: str, seed: int = 0, samples: int = 4) -> dict[str, list[str]]:
    """prompt -> the wrong responses `policy` gives in `samples` samples (temperature 1) on the
    arithmetic task's `split` prompts; a prompt it never got wrong is absent."""
    tokenizer = AutoTokenizer.from_pretrained(policy)
    prompts = load_prompts(DataConfig(task="arithmetic", task_seed=seed), tokenizer, split)
    actor = cluster.spawn(Actor, ActorConfig(model_path=str(policy)))
    rollout = RolloutConfig(n=samples, temperature=1.0, max_tokens=5, seed=seed, progress=False)
    mistakes: dict[str, list[str]] = {}
    for rows in iter_batches(prompts, 2048):
        batch = actor.generate(prompt_batch(rows), rollout)
        texts = response_texts(batch, tokenizer)
        for i, text in enumerate(texts):
            row = rows[i // samples]
            if not arithmetic_score(text, row.ground_truth):
                mistakes.setdefault(row.prompt, []).append(text)
    actor.close()
    return mistakes


def default_pair_rows(cluster, kind: str = "reward", size: str = "default", seed: int = 0,
                      cache_dir=None) -> tuple[list, list]:
    """(train, held-out) pairs of the embedded default's reward model (the right answer over the
    warmed-up policy's own mistakes, and over a `wrong_answer` per prompt) or cost model (the
    safety task's pairs)."""
    rows, samples = builtin_pair_rows(kind), DEFAULT_JUDGES[kind].mistake_samples
    if not samples:
        return rows("train", seed), rows("val", seed)
    policy = default_policy(cluster, size, seed, cache_dir=cache_dir)
    return tuple(rows(split, seed, mistakes=policy_mistakes(cluster, policy, split, seed, samples),
                      near_misses=DEFAULT_JUDGES[kind].near_misses) for split in ("train", "val"))


def default_reward_model_dir(kind: str = "reward", size: str = "default", seed: int = 0, cache_dir=None) -> Path:
    """Where `default_reward_model` caches its model (nothing is built here)."""
    judge = DEFAULT_JUDGES[kind]
    backbone = default_policy_dir(size, seed, judge.backbone_accuracy, cache_dir)
    return backbone.with_name(f"{backbone.name}-{kind}-r{judge.version}")


def default_reward_model(cluster, kind: str = "reward", rows: Callable[[str, int], list[dict]] | None = None,
                         size: str = "default", seed: int = 0, cache_dir=None) -> Path:
    """The embedded default's reward model (kind "reward") or cost model ("cost"), trained once
    and cached next to the warmed-up backbone it starts from (a new score head; see DEFAULT_JUDGES).

    Pairs: `rows(split, seed)` if given, else `default_pair_rows(kind)`. Trained on the whole
    cluster, then exported; the directory appears complete or not at all (written under a
    temporary name, renamed)."""
    judge = DEFAULT_JUDGES[kind]
    final = default_reward_model_dir(kind, size, seed, cache_dir)
    if rows is not None:
        final = final.with_name(f"{final.name}-{rows.__name__}")
    if (final / "config.json").exists():
        return final
    backbone = default_policy(cluster, size, seed, judge.backbone_accuracy, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    train, val = (rows("train", seed), rows("val", seed)) if rows else default_pair_rows(cluster, kind, size, seed, cache_dir)
    data = PairDataConfig()
    train, val = tokenize_pairs(train, tokenizer, data), tokenize_pairs(val, tokenizer, data)
    cost = kind == "cost"
    cfg = RewardModelConfig(model_path=str(backbone), trainable=True, micro_batch_size=64,
                            optim=OptimConfig(lr=judge.lr, warmup_steps=20, schedule=judge.schedule,
                                              total_steps=judge.steps))
    rm = cluster.spawn(RewardModel, cfg)
    print(f"training the embedded default's {kind} model on {len(train)} pairs (once; cached in {final})", flush=True)
    sampler = PromptSampler(train, data.batch_size, shuffle=True, seed=seed)
    loss_fn = functools.partial(pair_loss, cost=cost, center_coef=judge.center_coef)
    bar = progress(total=judge.steps, desc=f"{kind} model")
    for step in range(1, judge.steps + 1):
        metrics = rm.update(pair_batch(next(sampler), tokenizer.pad_token_id), loss_fn)[0]
        bar.update(1)
        if step % 100 == 0 or step == judge.steps:
            held_out = evaluate_pairs(rm, val, tokenizer.pad_token_id, cost)
            print(f"{kind} model step {step}: loss {metrics['rm/loss']:.4f}, held-out "
                  + ", ".join(f"{k} {v:.3f}" for k, v in held_out.items()), flush=True)
    bar.close()
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    rm.export_hf(str(tmp), str(backbone))
    rm.close()
    try:
        os.rename(tmp, final)
    except OSError:   # another run cached it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            raise
    return final
