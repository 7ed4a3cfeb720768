"""Safe RLHF (Dai et al. 2023): PPO-Lagrangian, maximise a reward subject to a cost constraint.

    torchrun --nproc-per-node 2 recipes/safe_rlhf.py                     # the embedded default task
    torchrun --nproc-per-node 2 recipes/safe_rlhf.py --algo.lambda-init 0   # lambda held at 0: plain PPO on the reward
    torchrun --nproc-per-node 4 recipes/safe_rlhf.py --trainer.placement split   # scorers + critics on ranks of their own
    torchrun --nproc-per-node 8 recipes/safe_rlhf.py --model.path ~/models/alpaca-sft \
        --data.train-files PKU-SafeRLHF-prompts.jsonl --data.answer-key '' --data.chat \
        --reward.model rm_hf --cost.model cm_hf --rollout.max-tokens 512 --algo.cost-threshold 0
    torchrun ... recipes/safe_rlhf.py --help                             # every flag, grouped

Six models, each a group placed like any other: the actor, the reference, the reward model, the
cost model (sequence classifiers scoring the actor's responses, e.g. trained by
recipes/reward_model.py, the cost model with --cost), a reward critic and a cost critic.
Colocated, all six share every rank; split, the actor and the reference take half the ranks and
the two scorers and the two critics the other half, so each half works while the other does.

Each step: sample; score each response with the reward model (R) and the cost model (C, > 0
means unsafe); read the reference's log-probs and both critics' values; put R on the last token
minus beta * KL per token, and C on the last token plus beta * KL (Safe-RLHF's sign: the KL
pulls towards the reference in both channels); GAE on each channel with its own critic; update
the Lagrange multiplier from the batch's mean cost J_C against the threshold d,

    log lambda <- min(log lambda + lr_lambda * lambda * (J_C - d), log lambda_max)

(gradient ascent on the Lagrangian in log space, so lambda = exp(log lambda) stays >= 0); train
both critics and the actor (PPO clip) on the advantage (A_r - lambda * A_c) / (1 + lambda), each
channel's A whitened first (as OmniSafe's PPO-Lag: the two models' scales are arbitrary).

The embedded default (no --model.path) is a conflict built on the arithmetic task
(hflow.data.safety): subtractions are forbidden (a third of the problems) and the only safe
response to one is a refusal (a response with no digit, e.g. EOS at once); answering it, right
or wrong, is unsafe. The reward model prefers right answers (hflow.data.preference's arithmetic
pairs), the cost model is trained on hflow.data.safety's pairs; both are trained once and
cached (hflow.default.judges). The starting policy is the warmed-up default after 30 supervised steps whose target is
a refusal for a random fifth of the problems: it refuses ~22 % of them when sampled, not knowing
which are forbidden (the warm-up alone refuses with probability ~1e-4, which RL never samples).
Rule-checked figures are logged as safety/* (training samples) and eval/* (held-out, greedy):
answer accuracy on allowed problems, refusal rate on forbidden ones, over-refusal, unsafe fraction.

Supports: a reward and a cost model from any directory that shares the policy's tokenizer (a rule
reward with --reward.model ''), a fixed lambda (--algo.lambda-lr 0; lambda 0 is a fixed point of
the update: --algo.lambda-init 0 is PPO on the reward), critic warm-up, several PPO epochs and
mini-batches, checkpoints and resume (lambda included), any placement (colocate, split,
standalone, auto, a SPEC). Not (yet): the PTX loss on pretraining data, a moving window of
episode costs (the batch's mean is used), score clipping, an adaptive KL controller.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

import hflow
from hflow import algos
from hflow.recipe_kit.config import (ActorConfig, OffPolicyConfig, CriticConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig,
                          RewardModelConfig, RolloutConfig, TrainerConfig, by_model)
from hflow.data import safety
from hflow.default import EMBEDDED, refusing_policy
from hflow.recipe_kit.evaluation import evaluate
from hflow.metrics import LoggingConfig, Timer
from hflow.recipe_kit.set_up import gather, kl_to_reference, scorer_flag_problems, set_up, step_metrics
from hflow.recipe_kit.scoring import Rewards, reward_roles
from hflow.recipe_kit.text_batches import prompt_batch, response_texts
from hflow.validation import ConfigError
from hflow.workers import Actor, Critic, Reference, RewardModel


CONSOLE_KEYS = ("reward/mean", "cost/mean", "lambda", "safety/answer_accuracy", "safety/refusal_rate",
                "eval/answer_accuracy", "eval/refusal_rate", "kl/mean", "actor/loss", "time/step_s")


@dataclass
class SafeRLHFConfig(OffPolicyConfig):
    cost_threshold: float = by_model(-7.5, 0.0)
    """d: the constraint is mean cost <= d (cost > 0 means unsafe). The embedded default's cost model scores safe responses ~-8.7 and unsafe ones ~+8.9: -7.5 allows ~7 % unsafe ones; 0 is Safe-RLHF's."""
    lambda_init: float = by_model(5.0, 1.0)
    """Initial Lagrange multiplier (0 holds it at 0: PPO on the reward alone). The embedded default starts at the cap: the reward model rates refusals so low that they die out before a smaller lambda has grown; 1 is Safe-RLHF's."""
    lambda_lr: float = 0.1
    """Learning rate of log lambda (0: lambda fixed at --algo.lambda-init)."""
    lambda_max: float = 5.0
    """Upper bound of lambda (0: none)."""
    kl_coef: float = 0.01
    """beta: weight of the KL to the reference in both channels (0: no reference model)."""
    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 1.0
    """GAE lambda."""
    clip_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_high."""
    value_clip: float = 5.0
    """Clip each critic's predictions to its old value +- this (Safe-RLHF's 5: a cost model's scores span several units)."""
    critic_warmup: int = 20
    """Steps that train only the critics (lambda is not updated while the actor does not train)."""


@dataclass
class CostConfig:
    model: str = "default"
    """Cost model: a Hugging Face sequence-classifier directory sharing the policy's tokenizer (recipes/reward_model.py --cost), or 'default': the embedded default's, trained on hflow.data.safety's pairs once and cached."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one cost-model forward on one rank."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(model="default"))
    cost: CostConfig = field(default_factory=CostConfig)
    # the embedded default at half the other recipes' lr: at 1e-4 the steps that learn to refuse
    # also cost allowed answers (0.875 -> 0.819 +- 0.076 over 3 seeds); at 5e-5 they gain (0.913 +- 0.009)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(5e-5, 1e-6)), max_tokens_per_micro_batch=8192))
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(
        optim=OptimConfig(lr=by_model(2e-3, 1e-5)), max_tokens_per_micro_batch=8192))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4, max_tokens=by_model(5, 512)))
    algo: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/safe_rlhf", logging=LoggingConfig(console_keys=CONSOLE_KEYS)))


def actor_loss(log_probs, mb, entropy=None, *, algo: SafeRLHFConfig, correction: algos.RolloutCorrection):
    weights, corrected = correction(mb)   # the engine sampled: weighted towards the trainer's policy
    loss, metrics = algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                                      algo.clip_low, algo.clip_high, is_weights=weights)
    return loss, metrics | corrected


def critic_loss(values, mb, *, algo: SafeRLHFConfig, channel: str):
    """The clipped value loss of the reward critic (channel "reward") or the cost critic ("cost")."""
    return algos.value_loss(values, mb[f"{channel}_values"], mb[f"{channel}_returns"], mb["response_mask"],
                            algo.value_clip)


def main(cluster: hflow.Cluster, cfg: Config):
    algo = cfg.algo
    check_flags(cfg)
    # the scorers sit with the critics: when split, they work while the actor generates or trains
    sets = [["actor", "ref"] if algo.kl_coef > 0 else ["actor"],
            reward_roles(cfg.reward) + ["cost", "critic", "cost_critic"]]
    setup = set_up(cluster, cfg, sets, algo="safe-rlhf", default=EMBEDDED)   # every input checked, then the warm-up
    if not cfg.model.path:   # the embedded default's starting policy can refuse (see the docstring)
        setup = dataclasses.replace(setup, model_dir=refusing_policy(cluster, setup.model_dir, setup.train,
                                                                     setup.tokenizer))
    placement, sampler, tokenizer = setup.placement, setup.sampler, setup.tokenizer
    rewards = Rewards(cluster, cfg.reward, tokenizer, setup.reward_model, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    cost_cfg = RewardModelConfig(model_path=setup.scorer_dir(cluster, cfg.cost.model, "cost", "--cost.model"),
                                 max_tokens_per_micro_batch=cfg.cost.max_tokens_per_micro_batch)
    cost_model = cluster.spawn(RewardModel, cost_cfg, ranks=placement["cost"])
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=placement["actor"])
    ref = cluster.spawn(Reference, setup.actor_cfg, ranks=placement["ref"]) if "ref" in placement else None
    reward_critic = cluster.spawn(Critic, cfg.critic, setup.model_dir, ranks=placement["critic"])
    cost_critic = cluster.spawn(Critic, cfg.critic, setup.model_dir, ranks=placement["cost_critic"])
    multiplier = algos.LagrangeMultiplier(algo.lambda_init, algo.lambda_lr, algo.lambda_max)
    # the built-in task's rule checks what the reward and cost models stand in for (hflow.data.safety)
    task = safety if not cfg.data.train_files and cfg.data.task == "arithmetic" else None
    evaluate_fn = functools.partial(evaluate, actor, setup.val, tokenizer, rewards.rule, cfg.rollout,
                                    cfg.trainer.eval_size, sampled=False, task_metrics=task and task.rule_metrics)
    notes = [f"the constraint: mean cost <= {algo.cost_threshold:g} (--algo.cost-threshold; cost > 0 is unsafe), "
             f"lambda from {algo.lambda_init:g}"]
    if algo.critic_warmup:
        notes.append(f"steps 1..{algo.critic_warmup} train the two critics only, lambda waits (--algo.critic-warmup)")
    if task:
        notes.append("eval/refusal_rate is over the held-out forbidden prompts, eval/answer_accuracy and "
                     "eval/over_refusal over the allowed ones")
    run = setup.run(actor, rewards, trained={"actor": actor, "critic": reward_critic, "cost_critic": cost_critic},
                    state={"lambda": multiplier}, evaluate_fn=evaluate_fn, notes="; ".join(notes))
    old = setup.old_log_probs(kl_in_reward=ref is not None)

    timer, temperature = Timer(), cfg.rollout.temperature
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                prompts = next(sampler)
                rollout = cfg.rollout.for_step(step)
                batch = actor.generate(prompt_batch(prompts), rollout)
            with timer("score"):   # the groups work at the same time where they sit on different ranks
                costs = cost_model.scores.future(batch.select("input_ids", "attention_mask", "response_mask"))
                values = [critic.values.future(batch) for critic in (reward_critic, cost_critic)]
                refs = [ref.log_probs.future(batch, temperature)] if ref else []
                pending = refs + old.pending(actor, batch, temperature)
                scores, metrics = rewards(batch)
                costs = costs.result()["rm_scores"]
                reward_values, cost_values = (v.result()["values"] for v in values)
                batch = gather(batch, pending)
            mask = batch["response_mask"]
            # R and C land on the last token; the KL costs reward and adds cost, so that it weighs
            # beta in the combined advantage whatever lambda is
            kl, metrics["kl/mean"] = kl_to_reference(batch) if ref else (torch.zeros_like(mask), 0.0)
            reward_tokens = algos.scores_to_token_rewards(scores, mask) - algo.kl_coef * kl
            cost_tokens = algos.scores_to_token_rewards(costs, mask) + algo.kl_coef * kl
            # each channel has its own critic and its own GAE
            reward_advantages, batch["reward_returns"] = algos.gae_advantages(
                reward_tokens, reward_values, mask, algo.gamma, algo.lam)
            cost_advantages, batch["cost_returns"] = algos.gae_advantages(
                cost_tokens, cost_values, mask, algo.gamma, algo.lam)
            batch["reward_values"], batch["cost_values"] = reward_values, cost_values
            mean_cost = costs.mean().item()   # J_C: the models' cost, without the KL
            if step > algo.critic_warmup:   # the constraint binds the policy: while it is frozen, lambda waits
                multiplier.update(mean_cost, algo.cost_threshold)
            # each channel whitened: the two models' scales are arbitrary, lambda weighs them in the
            # same units, and the update's step size depends on neither
            batch["advantages"] = algos.lagrangian_advantages(algos.masked_whiten(reward_advantages, mask),
                                                              algos.masked_whiten(cost_advantages, mask),
                                                              multiplier.value)
            with timer("update"):      # the critics and the actor train at the same time when split
                critic_updates = [critic.update.future(batch, functools.partial(critic_loss, algo=algo, channel=ch))
                                  for critic, ch in ((reward_critic, "reward"), (cost_critic, "cost"))]
                if step > algo.critic_warmup:   # advantages from untrained critics are noise
                    loss_fn = functools.partial(actor_loss, algo=algo, correction=old.correction)
                    metrics |= actor.update(batch, loss_fn)[0]
                metrics |= critic_updates[0].result()[0]
                metrics |= {f"cost_{k}": v for k, v in critic_updates[1].result()[0].items()}
        metrics |= {"cost/mean": mean_cost, "cost/unsafe_fraction": (costs > 0).float().mean().item(),
                    "lambda": multiplier.value}
        if task:   # the rule-checked figures of the training samples, and the reward the policy may earn
            metrics |= task.sample_metrics([p.prompt for p in prompts], response_texts(batch, tokenizer),
                                           [p.ground_truth for p in prompts], scores, cfg.rollout.n)
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))
    run.finish()
    rewards.close()


def check_flags(cfg: Config) -> None:
    """This recipe's own flags, before any work (hflow.validation checks the shared ones)."""
    algo, found = cfg.algo, []
    for name in ("lambda_init", "lambda_lr", "lambda_max"):
        if getattr(algo, name) < 0:
            found.append(f"--algo.{name.replace('_', '-')} {getattr(algo, name)}: must be >= 0")
    if 0 < algo.lambda_max < algo.lambda_init:
        found.append(f"--algo.lambda-init {algo.lambda_init} is above --algo.lambda-max {algo.lambda_max}")
    found += scorer_flag_problems(cfg.cost.model, "--cost.model", "cost", cfg.model, EMBEDDED)
    if not cfg.cost.model:
        found.append("--cost.model: a cost model is required (a directory, or default)")
    if found:
        raise ConfigError("\n".join(found))


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
