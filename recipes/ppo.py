"""PPO with a learned critic (Ouyang et al. 2022; Ziegler et al. 2019) — HybridFlow's main case.

    torchrun --nproc-per-node 2 recipes/ppo.py                      # the embedded default task
    torchrun --nproc-per-node 4 recipes/ppo.py --trainer.placement split   # critic on its own ranks
    torchrun --nproc-per-node 2 recipes/ppo.py --reward.model default      # a learned reward model only
    torchrun --nproc-per-node 2 recipes/ppo.py --trainer.async-steps 1 --trainer.placement "actor,ref,critic:0;rollout:1"
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

import functools
from dataclasses import dataclass, field
from typing import Literal

import hflow
from hflow import algos
from hflow.recipe_kit.config import (ActorConfig, OffPolicyConfig, CriticConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig,
                          RolloutConfig, TrainerConfig, by_model)
from hflow.default import EMBEDDED
from hflow.metrics import Timer
from hflow.recipe_kit.set_up import gather, kl_to_reference, set_up, step_metrics
from hflow.recipe_kit.scoring import Rewards, reward_roles
from hflow.recipe_kit.text_batches import prompt_batch
from hflow.workers import Actor, Critic, Reference


@dataclass
class PPOConfig(OffPolicyConfig):
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


def actor_loss(log_probs, mb, entropy=None, *, algo: PPOConfig, kl_coef: float,
               correction: algos.RolloutCorrection):
    mask = mb["response_mask"]
    # the clip keeps each update near the sampling policy; dual-clip bounds the loss of bad tokens
    weights, corrected = correction(mb)   # the engine sampled: weighted towards the trainer's policy
    loss, metrics = algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mask,
                                      algo.clip_low, algo.clip_high, algo.dual_clip, is_weights=weights)
    metrics |= corrected
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
    algo = cfg.algo
    # a reward model sits with the critic: when split, both work while the actor generates or trains
    sets = [["actor", "ref"] if algo.kl_coef > 0 else ["actor"], ["critic", *reward_roles(cfg.reward)]]
    # every input checked, then the warm-up; a rollout group of its own with --trainer.async-steps
    setup = set_up(cluster, cfg, sets, algo="ppo", default=EMBEDDED, asynchronous=True)
    placement, sampler = setup.placement, setup.sampler
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    kl_ctrl = algos.AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon) \
        if algo.kl_ctrl == "adaptive" else algos.FixedKLController(algo.kl_coef)
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=placement["actor"])
    ref = cluster.spawn(Reference, setup.actor_cfg, ranks=placement["ref"]) if "ref" in placement else None
    critic = cluster.spawn(Critic, cfg.critic, setup.model_dir, ranks=placement["critic"])
    # held-out accuracy is the rule's, also when a reward model (a proxy) gives the training score
    warm = f"steps 1..{algo.critic_warmup} train the critic only (--algo.critic-warmup)" if algo.critic_warmup else ""
    rollouts = setup.rollouts(cluster, actor)   # None: the actor's own engine generates
    run = setup.run(actor, rewards, trained={"actor": actor, "critic": critic},
                    state={"kl_ctrl": kl_ctrl, **({"rollouts": rollouts} if rollouts else {})}, notes=warm)
    # a KL in the reward needs the sampling policy's log-probs before the update
    old = setup.old_log_probs(kl_in_reward=ref is not None and not algo.kl_loss)

    timer, temperature = Timer(), cfg.rollout.temperature
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                if rollouts:   # generated ahead on the rollout group, while earlier steps trained
                    batch, pipeline = rollouts.take(step)
                else:
                    rollout = cfg.rollout.for_step(step)
                    batch, pipeline = actor.generate(prompt_batch(next(sampler)), rollout), {}
            scores, metrics = rewards(batch)
            metrics |= pipeline
            with timer("log_probs"):   # the groups work at the same time where they sit on different ranks
                parts = [critic.values.future(batch)] + ([ref.log_probs.future(batch, temperature)] if ref else [])
                batch = gather(batch, parts + old.pending(actor, batch, temperature))
            mask = batch["response_mask"]
            token_rewards = algos.scores_to_token_rewards(scores, mask)   # the score lands on the last token
            if ref:
                kl, metrics["kl/mean"] = kl_to_reference(batch)
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
                    loss_fn = functools.partial(actor_loss, algo=algo, kl_coef=kl_ctrl.value,
                                                correction=old.correction)
                    metrics |= actor.update(batch, loss_fn, with_entropy=algo.entropy_coef > 0)[0]
                metrics |= critic_update.result()[0]
            if rollouts:   # the new weights to the rollout group, behind the generations already issued
                rollouts.push(step)
        if ref:   # the adaptive controller moves beta towards --algo.kl-target (the fixed one ignores this)
            kl_ctrl.update(metrics["kl/mean"], len(batch))
        metrics["values/mean"] = algos.masked_mean(batch["values"], mask).item()
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
