"""GRPO: group-relative policy optimisation (Shao et al. 2024) — no critic.

    torchrun --nproc-per-node 2 recipes/grpo.py                     # the embedded default task
    torchrun --nproc-per-node 8 recipes/grpo.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \
        --data.chat --reward.fn gsm8k --rollout.max-tokens 512 --actor.optim.lr 1e-6
    torchrun ... recipes/grpo.py --help                             # every flag, grouped

Each step: sample `rollout.n` responses for each of `data.batch-size` prompts with the actor's
current weights (resharded into the generation engine on the same ranks), score them, take
A_i = (s_i - mean_group) / (std_group + eps) for every token of response i, and update the actor
with the PPO clipped loss (+ a k3 KL loss to the reference policy when `--algo.kl-coef` > 0).

Supports: any supported Hugging Face causal LM, jsonl/parquet prompts, rule rewards or
`module:function`, Dr.GRPO (`--algo.no-norm-by-std`), clip-higher, several PPO epochs and
mini-batches, checkpoints and resume, colocated or split (reference on its own ranks) placement.
Not (yet): reward models, multi-turn rollouts, sequence packing.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

import hflow
from hflow import algos
from hflow.config import (ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                          TrainerConfig)
from hflow.data import PromptSampler
from hflow.metrics import Timer
from hflow.placement import colocate, split
from hflow.evaluation import evaluate
from hflow.recipe import policy_and_prompts, prompt_batch, rollout_metrics, score
from hflow.rewards import Scorer
from hflow.run import Run
from hflow.workers import Actor, check_batch_sizes, is_on_policy, Reference, rollout_log_probs_exact


@dataclass
class GRPOConfig:
    clip_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_high (DAPO's clip-higher: raise it)."""
    kl_coef: float = 0.0
    """Weight of the KL loss to the reference policy (0: no reference model at all)."""
    kl_kind: str = "low_var_kl"
    """KL estimator of that loss: k1, k2, k3, abs, low_var_kl (k3, clamped)."""
    norm_by_std: bool = True
    """Divide by the group's std (False: Dr.GRPO)."""
    loss_agg: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean."""
    old_log_probs: Literal["auto", "recompute", "rollout"] = "auto"
    """Old log-probs of an off-policy update (several epochs or mini-batches): a forward pass of the actor (recompute), the engine's own (rollout), or auto: the engine's when the actor computes in fp32 (then they are equal; in bf16 they are not). An on-policy update needs neither."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=1e-4), max_tokens_per_micro_batch=8192))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=8, max_tokens=5))
    algo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/grpo"))


def grpo_loss(log_probs, mb, entropy=None, *, algo: GRPOConfig):
    """PPO clipped surrogate on group-relative advantages, plus the KL loss to the reference."""
    mask = mb["response_mask"]
    # clipped below and above apart: a higher upper clip (DAPO) lets rare good tokens gain faster
    loss, metrics = algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mask,
                                      algo.clip_low, algo.clip_high, agg=algo.loss_agg)
    if algo.kl_coef > 0:   # GRPO puts the KL in the loss, not the reward: advantages stay group-relative
        kl = algos.masked_mean(algos.kl_penalty(log_probs, mb["ref_log_probs"], algo.kl_kind), mask)
        loss = loss + algo.kl_coef * kl
        metrics["kl_loss"] = kl.item()
    return loss, metrics


def main(cluster: hflow.Cluster, cfg: Config):
    roles = ["actor", "ref"] if cfg.algo.kl_coef > 0 else ["actor"]
    plan = split([[r] for r in roles], cluster.world_size) if cfg.trainer.placement == "split" \
        else colocate(roles, cluster.world_size)
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.actor.mini_batch_size, len(plan["actor"]))
    model_dir, tokenizer, train, val = policy_and_prompts(cluster, cfg.model, cfg.data)
    sampler = PromptSampler(train, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    scorer = Scorer(cfg.reward)
    actor_cfg = dataclasses.replace(cfg.actor, model_path=model_dir)
    actor = cluster.spawn(Actor, actor_cfg, ranks=plan["actor"])
    ref = cluster.spawn(Reference, actor_cfg, ranks=plan["ref"]) if "ref" in plan else None
    evaluate_now = functools.partial(evaluate, actor, val, tokenizer, scorer, cfg.rollout, cfg.trainer.eval_size)
    run = Run(cfg.trainer, trained={"actor": actor}, state={"data": sampler}, evaluate=evaluate_now,
              export=(actor, model_dir))

    loss_fn = functools.partial(grpo_loss, algo=cfg.algo)
    on_policy = is_on_policy(cfg.actor, cfg.data.batch_size)
    old_from_rollout = cfg.algo.old_log_probs == "rollout" or (
        cfg.algo.old_log_probs == "auto" and rollout_log_probs_exact(cfg.actor, cluster.device_type))
    timer = Timer()
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                rollout = dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + step)
                batch = actor.generate(prompt_batch(next(sampler)), rollout)
            scores, metrics = score(batch, tokenizer, scorer)
            mask = batch["response_mask"]
            groups = torch.arange(len(batch)) // cfg.rollout.n       # the n samples of a prompt are adjacent
            # the group's mean is the baseline: no critic; a group whose samples all scored alike teaches nothing
            batch["advantages"] = algos.grpo_advantages(scores, groups, mask, cfg.algo.norm_by_std)
            with timer("log_probs"):
                refs = ref.log_probs.future(batch, cfg.rollout.temperature) if ref else None
                if not on_policy:   # (on-policy, the update's own detached log-probs are the old ones: one forward fewer)
                    batch["old_log_probs"] = batch["rollout_log_probs"] if old_from_rollout else \
                        actor.log_probs(batch, cfg.rollout.temperature)["old_log_probs"]
                if refs:
                    batch = batch | refs.result()
            with timer("update"):
                metrics |= actor.update(batch, loss_fn)[0]
        if ref:   # KL of the sampling policy to the reference (on-policy: the engine's log-probs of it)
            sampled = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
            metrics["kl/mean"] = algos.masked_mean(algos.kl_penalty(sampled, batch["ref_log_probs"], "k1"),
                                                   mask).item()
        else:   # no reference: KL of the updated policy to the one that sampled, as the loss saw it
            metrics["kl/mean"] = metrics.get("actor/approx_kl", 0.0)
        metrics |= rollout_metrics(batch) | timer.pop()
        metrics["throughput/tokens_per_s"] = mask.sum().item() / metrics["time/step_s"]
        run.end_step(step, metrics)
    run.finish()
    scorer.close()


if __name__ == "__main__":
    hflow.launch(main, tyro.cli(Config))
