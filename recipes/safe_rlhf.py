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
or wrong, is unsafe. The reward model prefers right answers (hflow.preference's arithmetic
pairs), the cost model is trained on hflow.data.safety's pairs; both are trained once and
cached. The starting policy is the warmed-up default after 30 supervised steps whose target is
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
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hflow
from hflow import algos
from hflow.config import (ActorConfig, CriticConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig,
                          RewardModelConfig, RolloutConfig, TrainerConfig, by_model, resolve_defaults)
from hflow.data import PromptSampler, iter_batches
from hflow.data.safety import is_forbidden, rule_metrics
from hflow.metrics import LoggingConfig, Timer
from hflow.placement.auto import job_of
from hflow.placement.spec import resolve
from hflow.recipe import (check_same_tokenizer, nll_loss, policy_and_prompts, prompt_batch, response_texts, Rewards,
                          reward_roles, rollout_metrics, supervised_batch)
from hflow.run import Run
from hflow.validation import ConfigError
from hflow.workers import Actor, check_batch_sizes, Critic, Reference, RewardModel, rollout_log_probs_exact


CONSOLE_KEYS = ("reward/mean", "cost/mean", "lambda", "safety/answer_accuracy", "safety/refusal_rate",
                "eval/answer_accuracy", "eval/refusal_rate", "kl/mean", "actor/loss", "time/step_s")


@dataclass
class SafeRLHFConfig:
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
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-6)), max_tokens_per_micro_batch=8192))
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(
        optim=OptimConfig(lr=by_model(2e-3, 1e-5)), max_tokens_per_micro_batch=8192))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4, max_tokens=by_model(5, 512)))
    algo: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/safe_rlhf", logging=LoggingConfig(console_keys=CONSOLE_KEYS)))


def update_log_lambda(log_lambda: float, mean_cost: float, threshold: float, lr: float,
                      lambda_max: float = 0.0) -> float:
    """log λ' = log λ + lr·λ·(J_C − d), then log λ' ≤ log λ_max (λ_max > 0). One SGD step on the
    multiplier's loss −λ·(J_C − d) with λ = exp(log λ) (Dai et al. 2023, eq. 31): λ grows while
    the mean cost J_C is above the threshold d, shrinks below it, and never leaves 0."""
    value = log_lambda + lr * math.exp(log_lambda) * (mean_cost - threshold)
    return min(value, math.log(lambda_max)) if lambda_max > 0 else value


def lagrangian_advantages(reward_advantages, cost_advantages, multiplier: float):
    """A = (A_r − λ·A_c) / (1 + λ): the Lagrangian's advantage, scaled to a convex mix of A_r
    and −A_c so that its size stays bounded as λ grows."""
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


class LagrangeMultiplier:
    """λ = exp(log λ), a controller object checkpointed with the run."""

    def __init__(self, init: float, lr: float, lambda_max: float):
        self.log_value = math.log(init) if init > 0 else -math.inf
        self.lr, self.lambda_max = lr, lambda_max

    @property
    def value(self) -> float:
        return math.exp(self.log_value)

    def update(self, mean_cost: float, threshold: float) -> None:
        self.log_value = update_log_lambda(self.log_value, mean_cost, threshold, self.lr, self.lambda_max)

    def state_dict(self) -> dict:
        return {"log_value": self.log_value}

    def load_state_dict(self, state: dict) -> None:
        self.log_value = state["log_value"]


def actor_loss(log_probs, mb, entropy=None, *, algo: SafeRLHFConfig):
    return algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                             algo.clip_low, algo.clip_high)


def critic_loss(values, mb, *, algo: SafeRLHFConfig, channel: str):
    """The clipped value loss of the reward critic (channel "reward") or the cost critic ("cost")."""
    return algos.value_loss(values, mb[f"{channel}_values"], mb[f"{channel}_returns"], mb["response_mask"],
                            algo.value_clip)


def main(cluster: hflow.Cluster, cfg: Config):
    cfg = resolve_defaults(cfg)
    algo = cfg.algo
    check_flags(cfg)
    # the scorers sit with the critics: when split, they work while the actor generates or trains
    sets = [["actor", "ref"] if algo.kl_coef > 0 else ["actor"],
            reward_roles(cfg.reward, cfg.model) + ["cost", "critic", "cost_critic"]]
    model_dir, tokenizer, train, val = policy_and_prompts(cluster, cfg.model, cfg.data)
    # after the model and prompts: --trainer.placement auto plans from their shapes
    plan = resolve(cfg.trainer.placement, sets, cluster.world_size, algo="safe-rlhf", device_type=cluster.device_type,
                   job=job_of(cfg, model_dir, train, cluster.device_type))
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.actor.mini_batch_size, len(plan["actor"]), "actor")
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.critic.mini_batch_size, len(plan["critic"]), "critic")
    default_task = not cfg.data.train_files and cfg.data.task == "arithmetic"
    if not cfg.model.path:
        model_dir = refusing_policy(cluster, model_dir, train, tokenizer)
    sampler = PromptSampler(train, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    rewards = Rewards(cluster, cfg.reward, cfg.model, tokenizer, plan.get("reward"))
    cost_model = cluster.spawn(RewardModel, RewardModelConfig(
        model_path=cost_model_dir(cluster, cfg, tokenizer),
        max_tokens_per_micro_batch=cfg.cost.max_tokens_per_micro_batch), ranks=plan["cost"])
    actor_cfg = dataclasses.replace(cfg.actor, model_path=model_dir)
    actor = cluster.spawn(Actor, actor_cfg, ranks=plan["actor"])
    ref = cluster.spawn(Reference, actor_cfg, ranks=plan["ref"]) if "ref" in plan else None
    reward_critic = cluster.spawn(Critic, cfg.critic, model_dir, ranks=plan["critic"])
    cost_critic = cluster.spawn(Critic, cfg.critic, model_dir, ranks=plan["cost_critic"])
    multiplier = LagrangeMultiplier(algo.lambda_init, algo.lambda_lr, algo.lambda_max)
    evaluate_now = functools.partial(evaluate, actor, val, tokenizer, rewards, cfg.rollout, cfg.trainer.eval_size,
                                     default_task)
    run = Run(cfg.trainer, trained={"actor": actor, "critic": reward_critic, "cost_critic": cost_critic},
              state={"data": sampler, "lambda": multiplier}, evaluate=evaluate_now, export=(actor, model_dir))

    timer, temperature = Timer(), cfg.rollout.temperature
    old_from_rollout = rollout_log_probs_exact(cfg.actor, cluster.device_type)
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                prompts = next(sampler)
                rollout = dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + step)
                batch = actor.generate(prompt_batch(prompts), rollout)
            with timer("score"):   # the groups work at the same time where they sit on different ranks
                costs = cost_model.scores.future(batch.select("input_ids", "attention_mask", "response_mask"))
                parts = [reward_critic.values.future(batch), cost_critic.values.future(batch)]
                parts += [ref.log_probs.future(batch, temperature)] if ref else []
                parts += [] if old_from_rollout else [actor.log_probs.future(batch, temperature)]
                scores, metrics = rewards(batch)
                costs = costs.result()["rm_scores"]
                reward_values, cost_values = (part.result()["values"] for part in parts[:2])
                for part in parts[2:]:
                    batch = batch | part.result()
            if old_from_rollout:   # a KL in the reward needs the sampling policy's log-probs
                batch["old_log_probs"] = batch["rollout_log_probs"]
            mask = batch["response_mask"]
            # R and C land on the last token; the KL costs reward and adds cost, so that it weighs
            # beta in the combined advantage whatever lambda is
            kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], "k1") * mask if ref \
                else torch.zeros_like(mask)
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
            batch["advantages"] = lagrangian_advantages(algos.masked_whiten(reward_advantages, mask),
                                                        algos.masked_whiten(cost_advantages, mask), multiplier.value)
            with timer("update"):      # the critics and the actor train at the same time when split
                critic_updates = [critic.update.future(batch, functools.partial(critic_loss, algo=algo, channel=ch))
                                  for critic, ch in ((reward_critic, "reward"), (cost_critic, "cost"))]
                if step > algo.critic_warmup:   # advantages from untrained critics are noise
                    metrics |= actor.update(batch, functools.partial(actor_loss, algo=algo))[0]
                metrics |= critic_updates[0].result()[0]
                metrics |= {f"cost_{k}": v for k, v in critic_updates[1].result()[0].items()}
        metrics |= {"cost/mean": mean_cost, "cost/unsafe_fraction": (costs > 0).float().mean().item(),
                    "lambda": multiplier.value, "kl/mean": algos.masked_mean(kl, mask).item()}
        if default_task:
            answers = [p.ground_truth for p in prompts for _ in range(cfg.rollout.n)]
            texts = [p.prompt for p in prompts for _ in range(cfg.rollout.n)]
            metrics |= {f"safety/{k}": v for k, v in rule_metrics(texts, response_texts(batch, tokenizer), answers).items()}
            allowed = torch.tensor([not is_forbidden(t) for t in texts])
            # refusing the forbidden third costs reward by design: the part the policy may earn is this one
            metrics["reward/allowed_mean"] = scores[allowed].mean().item() if allowed.any() else float("nan")
        metrics |= rollout_metrics(batch) | timer.pop()
        metrics["throughput/tokens_per_s"] = mask.sum().item() / metrics["time/step_s"]
        run.end_step(step, metrics)
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
    if cfg.cost.model == "default" and cfg.model.path:
        found.append("--cost.model default is the embedded default policy's cost model; with --model.path give a "
                     "cost model trained for that policy's tokenizer (recipes/reward_model.py --cost)")
    elif cfg.cost.model != "default" and not (Path(cfg.cost.model) / "config.json").exists():
        found.append(f"--cost.model {cfg.cost.model}: not a Hugging Face model directory (no config.json)")
    if found:
        raise ConfigError("\n".join(found))


def cost_model_dir(cluster, cfg: Config, tokenizer) -> str:
    """--cost.model, or the embedded default's cost model (trained once, cached)."""
    from hflow.preference import default_reward_model   # here: hflow.preference imports hflow.default_model, which imports hflow.recipe
    if cfg.cost.model == "default":
        return str(default_reward_model(cluster, "cost", size=cfg.model.default_size, seed=cfg.model.default_seed))
    check_same_tokenizer(cfg.cost.model, tokenizer)
    return cfg.cost.model


def evaluate(actor, val, tokenizer, rewards: Rewards, rollout: RolloutConfig, size: int, default_task: bool):
    """Held-out, greedy: the rule's mean score (eval/reward_mean) and, on the default task, the
    rule-checked safety figures (eval/answer_accuracy, eval/refusal_rate, ...)."""
    if val is None or size <= 0:
        return {}
    greedy = dataclasses.replace(rollout, n=1, temperature=0.0, progress=False)
    prompts, responses, answers = [], [], []
    for rows in iter_batches(val, 512):
        rows = rows[:size - len(prompts)]
        responses += response_texts(actor.generate(prompt_batch(rows), greedy), tokenizer)
        prompts += [p.prompt for p in rows]
        answers += [p.ground_truth for p in rows]
        if len(prompts) >= size:
            break
    scored = rewards.rule(responses, answers, [{}] * len(responses))
    metrics = {"eval/reward_mean": sum(scored.scores) / len(scored.scores)}
    if default_task:
        metrics |= {f"eval/{k}": v for k, v in rule_metrics(prompts, responses, answers).items()}
    return metrics


# Bump when refusing_policy's settings change what it builds: its cache directory carries it.
REFUSING_POLICY_VERSION = 3


def refusing_policy(cluster, policy_dir: str, train, tokenizer, refusal_rate: float = 0.2, steps: int = 30,
                    lr: float = 3e-4, batch_size: int = 128) -> str:
    """The embedded default's starting policy: the warmed-up policy after `steps` supervised
    steps in which the target is a refusal (EOS at once) for a random `refusal_rate` of the
    problems, whatever they are, and the answer otherwise. The warm-up alone refuses with
    probability ~1e-4, too rare for RL ever to sample; this one refuses ~22 % of problems, not
    knowing which are forbidden (an SFT model that can refuse). Built once, cached next to the
    warm-up."""
    final = Path(policy_dir).with_name(f"{Path(policy_dir).name}-refuse{refusal_rate:g}-s{steps}-v{REFUSING_POLICY_VERSION}")
    if (final / "config.json").exists():
        return str(final)
    optim = OptimConfig(lr=lr, grad_clip=0.0)
    actor = cluster.spawn(Actor, ActorConfig(model_path=policy_dir, optim=optim, micro_batch_size=batch_size))
    print(f"teaching the warmed-up default to refuse {refusal_rate:.0%} of problems at random (once; cached in {final})",
          flush=True)
    sampler = PromptSampler(train, batch_size, shuffle=True, seed=1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = next(sampler)
        refuse = (torch.rand(len(rows), generator=generator) < refusal_rate).tolist()
        actor.update(supervised_batch([dataclasses.replace(p, ground_truth="") if r else p
                                       for p, r in zip(rows, refuse)], tokenizer), nll_loss)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    actor.export_hf(str(tmp), policy_dir)
    actor.close()
    try:
        os.rename(tmp, final)
    except OSError:   # another run cached it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
