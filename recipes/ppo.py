"""PPO with a learned critic (Ouyang et al. 2022; Ziegler et al. 2019) — HybridFlow's main case.

    torchrun --nproc-per-node 2 recipes/ppo.py                      # the embedded default task
    torchrun --nproc-per-node 4 recipes/ppo.py --trainer.placement split   # critic on its own ranks
    torchrun --nproc-per-node 2 recipes/ppo.py --reward.model default      # a learned reward model only
    torchrun --nproc-per-node 8 recipes/ppo.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \
        --data.chat --reward.fn gsm8k --rollout.max-tokens 512 --actor.optim.lr 1e-6
    torchrun ... recipes/ppo.py --help                              # every flag, grouped

Each step: sample responses with the actor (resharded into the generation engine on its own
ranks), score them (the rule `--reward.fn`, a reward model `--reward.model`, or rule + w * rm),
read log-probs of the actor and the reference and the critic's values, put the score on the
last token and -beta * KL(actor || ref) on every token, estimate advantages with GAE (whitened), then train the critic (clipped value loss) and — after
`--algo.critic-warmup` steps — the actor (PPO clipped loss, optional entropy bonus), for
`--actor.epochs` passes over `--actor.mini-batch-size` mini-batches.

Supports: a reward model in the loop (a directory from recipes/reward_model.py, or `default`: the
embedded default's, trained once and cached; the held-out accuracy stays the rule's), a fixed or
adaptive KL controller, or KL as a loss (`--algo.kl-loss`), clip-higher and dual-clip, value
clipping, critic warm-up, colocated or split placement (actor+reference and critic+reward model
on disjoint ranks, running concurrently), checkpoints and resume, Hugging Face export.
Not (yet): multi-turn.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal

import torch

import hflow
from hflow import algos
from hflow.config import (ActorConfig, CriticConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig,
                          RolloutConfig, TrainerConfig, by_model, resolve_defaults)
from hflow.data import PromptSampler
from hflow.metrics import Timer
from hflow.placement.auto import job_of
from hflow.placement.spec import resolve
from hflow.evaluation import evaluate
from hflow.recipe import policy_and_prompts, prompt_batch, Rewards, reward_roles, rollout_metrics
from hflow.run import Run
from hflow.workers import Actor, check_batch_sizes, Critic, is_on_policy, Reference, rollout_log_probs_exact


@dataclass
class PPOConfig:
    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 1.0
    """GAE lambda."""
    kl_coef: float = 0.001
    """beta: weight of the KL penalty (in the reward, or as a loss with --algo.kl-loss); 0: no reference model."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """Keep beta fixed, or adapt it towards --algo.kl-target (Ziegler et al.)."""
    kl_target: float = 0.01
    """Target KL per token of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller."""
    kl_loss: bool = False
    """Put the KL in the actor's loss (k3) instead of the reward."""
    clip_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_high."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    value_clip: float = 0.5
    """Clip value predictions to old value +- this."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    critic_warmup: int = 20
    """Steps that train only the critic before the actor starts."""
    old_log_probs: Literal["auto", "recompute", "rollout"] = "auto"
    """Old log-probs (for the KL in the reward, or an off-policy update): a forward pass of the actor (recompute), the engine's own (rollout), or auto: the engine's when the actor computes in fp32 (then they are equal; in bf16 they are not). An on-policy update without a KL reward needs neither."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-6)), max_tokens_per_micro_batch=8192))
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(
        optim=OptimConfig(lr=by_model(2e-3, 1e-5)), max_tokens_per_micro_batch=8192))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4, max_tokens=by_model(5, 512)))
    algo: PPOConfig = field(default_factory=PPOConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/ppo"))


def actor_loss(log_probs, mb, entropy=None, *, algo: PPOConfig, kl_coef: float):
    mask = mb["response_mask"]
    # the clip keeps each update near the sampling policy; dual-clip bounds the loss of bad tokens
    loss, metrics = algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mask,
                                      algo.clip_low, algo.clip_high, algo.dual_clip)
    if algo.kl_loss and kl_coef > 0:
        kl = algos.masked_mean(algos.kl_penalty(log_probs, mb["ref_log_probs"], "low_var_kl"), mask)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl.item()
    if entropy is not None:
        mean_entropy = algos.masked_mean(entropy, mask)
        loss = loss - algo.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.item()
    return loss, metrics


def critic_loss(values, mb, *, algo: PPOConfig):
    loss, metrics = algos.value_loss(values, mb["values"], mb["returns"], mb["response_mask"], algo.value_clip)
    return loss, {**metrics, "vpred_mean": algos.masked_mean(values, mb["response_mask"]).item()}


def main(cluster: hflow.Cluster, cfg: Config):
    cfg = resolve_defaults(cfg)   # the toy values for the embedded default, the usual ones for --model.path
    algo = cfg.algo
    # a reward model sits with the critic: when split, both work while the actor generates or trains
    sets = [["actor", "ref"] if algo.kl_coef > 0 else ["actor"], ["critic"] + reward_roles(cfg.reward, cfg.model)]
    model_dir, tokenizer, train, val = policy_and_prompts(cluster, cfg.model, cfg.data)
    # after the model and prompts: --trainer.placement auto plans from their shapes
    plan = resolve(cfg.trainer.placement, sets, cluster.world_size, algo="ppo", device_type=cluster.device_type,
                   job=job_of(cfg, model_dir, train, cluster.device_type))
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.actor.mini_batch_size, len(plan["actor"]), "actor")
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.critic.mini_batch_size, len(plan["critic"]), "critic")
    sampler = PromptSampler(train, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    rewards = Rewards(cluster, cfg.reward, cfg.model, tokenizer, plan.get("reward"))
    kl_ctrl = algos.AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon) \
        if algo.kl_ctrl == "adaptive" else algos.FixedKLController(algo.kl_coef)
    actor_cfg = dataclasses.replace(cfg.actor, model_path=model_dir)
    actor = cluster.spawn(Actor, actor_cfg, ranks=plan["actor"])
    ref = cluster.spawn(Reference, actor_cfg, ranks=plan["ref"]) if "ref" in plan else None
    critic = cluster.spawn(Critic, cfg.critic, model_dir, ranks=plan["critic"])
    # held-out accuracy is the rule's, also when a reward model (a proxy) gives the training score
    evaluate_now = functools.partial(evaluate, actor, val, tokenizer, rewards.rule, cfg.rollout, cfg.trainer.eval_size)
    run = Run(cfg.trainer, trained={"actor": actor, "critic": critic}, state={"data": sampler, "kl_ctrl": kl_ctrl},
              evaluate=evaluate_now, export=(actor, model_dir))

    timer, temperature = Timer(), cfg.rollout.temperature
    # on-policy, the update's own log-probs (detached) are the old ones: ratio 1, one forward fewer;
    # a KL in the reward still needs the sampling policy's log-probs before the update
    need_old = not is_on_policy(cfg.actor, cfg.data.batch_size) or (ref is not None and not algo.kl_loss)
    old_from_rollout = algo.old_log_probs == "rollout" or (
        algo.old_log_probs == "auto" and rollout_log_probs_exact(cfg.actor, cluster.device_type))
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                rollout = dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + step)
                batch = actor.generate(prompt_batch(next(sampler)), rollout)
            scores, metrics = rewards(batch)
            with timer("log_probs"):   # the groups work at the same time where they sit on different ranks
                parts = [critic.values.future(batch)] + ([ref.log_probs.future(batch, temperature)] if ref else [])
                if need_old and old_from_rollout:
                    batch["old_log_probs"] = batch["rollout_log_probs"]
                elif need_old:
                    parts.append(actor.log_probs.future(batch, temperature))
                for part in parts:
                    batch = batch | part.result()
            mask = batch["response_mask"]
            token_rewards = algos.scores_to_token_rewards(scores, mask)   # the score lands on the last token
            if ref:
                sampled = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
                kl = algos.kl_penalty(sampled, batch["ref_log_probs"], "k1") * mask
                metrics["kl/mean"] = algos.masked_mean(kl, mask).item()
                metrics["kl/coef"] = kl_ctrl.value
                if not algo.kl_loss:   # the KL in the reward keeps each token near the reference policy
                    token_rewards = token_rewards - kl_ctrl.value * kl
            advantages, batch["returns"] = algos.gae_advantages(token_rewards, batch["values"], mask,
                                                                algo.gamma, algo.lam)
            # whitened: the update's step size no longer depends on the reward's scale
            batch["advantages"] = algos.masked_whiten(advantages, mask)
            # of values the critic has not trained on yet: does it predict more than the batch's mean?
            metrics["critic/vf_explained_var"] = algos.explained_variance(batch["values"], batch["returns"], mask)
            with timer("update"):      # the critic and the actor train at the same time when split
                critic_update = critic.update.future(batch, functools.partial(critic_loss, algo=algo))
                if step > algo.critic_warmup:   # advantages from an untrained critic are noise
                    loss_fn = functools.partial(actor_loss, algo=algo, kl_coef=kl_ctrl.value)
                    metrics |= actor.update(batch, loss_fn, with_entropy=algo.entropy_coef > 0)[0]
                metrics |= critic_update.result()[0]
        if ref:   # the adaptive controller moves beta towards --algo.kl-target (the fixed one ignores this)
            kl_ctrl.update(metrics["kl/mean"], len(batch))
        metrics |= rollout_metrics(batch) | timer.pop()
        metrics["values/mean"] = algos.masked_mean(batch["values"], mask).item()
        metrics["throughput/tokens_per_s"] = mask.sum().item() / metrics["time/step_s"]
        run.end_step(step, metrics)
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
