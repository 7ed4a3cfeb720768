"""The embedded default's judges: a reward model that ranks right answers over wrong ones and a
cost model for the safety task, each trained once on the whole cluster and cached next to the
warmed-up backbone it starts from (a new score head).

    path = default_reward_model(cluster, "reward")   # or "cost"
    train, val = default_pair_rows(cluster, "reward")   # the pairs it trains on
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from transformers import AutoTokenizer

from hflow.runtime import stopping
from hflow.algos import pair_loss
from hflow.data import DataConfig, PromptSampler, iter_batches, load_prompts
from hflow.data.preference import PairDataConfig, builtin_pair_rows, pair_batch, tokenize_pairs
from hflow.default.cache import build_once
from hflow.default.warm_up import default_policy, default_policy_dir
from hflow.recipe_kit.evaluation import evaluate_pairs
from hflow.metrics import progress
from hflow.rewards.arithmetic import arithmetic_score
from hflow.recipe_kit.text_batches import prompt_batch, response_texts
from hflow.workers import Actor, ActorConfig, OptimConfig, RewardModel, RewardModelConfig, RolloutConfig


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

    def train_judge(out: Path) -> None:
        backbone = default_policy(cluster, size, seed, judge.backbone_accuracy, cache_dir=cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(backbone)
        train, val = (rows("train", seed), rows("val", seed)) if rows else \
            default_pair_rows(cluster, kind, size, seed, cache_dir)
        data = PairDataConfig()
        train, val = tokenize_pairs(train, tokenizer, data), tokenize_pairs(val, tokenizer, data)
        cost = kind == "cost"
        cfg = RewardModelConfig(model_path=str(backbone), trainable=True, micro_batch_size=64,
                                optim=OptimConfig(lr=judge.lr, warmup_steps=20, schedule=judge.schedule,
                                                  total_steps=judge.steps))
        rm = cluster.spawn(RewardModel, cfg)
        print(f"training the embedded default's {kind} model on {len(train)} pairs (once; cached in {final})",
              flush=True)
        sampler = PromptSampler(train, data.batch_size, shuffle=True, seed=seed)
        loss_fn = functools.partial(pair_loss, cost=cost, center_coef=judge.center_coef)
        bar = progress(total=judge.steps, desc=f"{kind} model")
        for step in range(1, judge.steps + 1):
            metrics = rm.update(pair_batch(next(sampler), tokenizer.pad_token_id), loss_fn)[0]
            bar.update(1)
            stopping.stop_if_asked(f"while training the embedded default's {kind} model (step {step} of "
                                   f"{judge.steps}; nothing cached: it is trained again next time)")
            if step % 100 == 0 or step == judge.steps:
                held_out = evaluate_pairs(rm, val, tokenizer.pad_token_id, cost)
                print(f"{kind} model step {step}: loss {metrics['rm/loss']:.4f}, held-out "
                      + ", ".join(f"{k} {v:.3f}" for k, v in held_out.items()), flush=True)
        bar.close()
        rm.export_hf(str(out), str(backbone))
        rm.close()

    return build_once(final, train_judge)
