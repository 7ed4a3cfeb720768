"""GRPO and its critic-free relatives: RLOO, REINFORCE++, Dr.GRPO, DAPO, GSPO, CISPO, SAPO — one dataflow.

    torchrun --nproc-per-node 2 recipes/grpo.py                     # the embedded default task
    torchrun --nproc-per-node 2 recipes/grpo.py --algo.estimator rloo --algo.kl-coef 0.001
    torchrun --nproc-per-node 2 recipes/grpo.py --algo.clip-high 0.28 --algo.dynamic-sampling \
        --algo.overlong-buffer 2                                    # DAPO
    torchrun --nproc-per-node 2 recipes/grpo.py --algo.loss gspo    # GSPO (or cispo, sapo)
    torchrun --nproc-per-node 2 recipes/grpo.py --trainer.async-steps 1 --trainer.placement split
                                                                    # asynchronous: rank 1 generates ahead
    torchrun --nproc-per-node 8 recipes/grpo.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \
        --data.chat --reward.fn gsm8k
    torchrun ... recipes/grpo.py --help                             # every flag, grouped

Each step: sample `rollout.n` responses for each of `data.batch-size` prompts with the actor's
current weights (resharded into the generation engine on the same ranks), score them, turn the
scores into advantages with `--algo.estimator`, and update the actor with the clipped loss
`--algo.loss` (+ a KL loss to the reference policy when `--algo.kl-coef` > 0 and the KL is not
in the reward). With s_i the reward of response i (its score, minus beta * sum_t KL_t when the KL
is in the reward) and g the n responses to its prompt:

    grpo                   A_i = (s_i - mean_g) / (std_g + eps)        Shao et al. 2024
    drgrpo                 A_i = s_i - mean_g                          Liu et al. 2025 (= --algo.no-norm-by-std)
    rloo                   A_i = n/(n-1) * (s_i - mean_g)              Ahmadian et al. 2024 (leave one out)
    reinforce_pp           A_t = whiten_batch(sum_{t'>=t} gamma^(t'-t) r_t'),  r_t = score at the
                           last token - beta * KL_t                    Hu 2025
    reinforce_pp_baseline  A_i = whiten_batch(s_i - mean_g)            Hu 2025

whiten_batch: minus the mean, over the std, of every response token of the batch. The KL to the
reference is in the loss (--algo.kl-kind) for grpo and drgrpo, in the reward (k1 per token) for
rloo and the REINFORCE++ pair, as their papers have it (`--algo.kl-in-reward` overrides).

Losses (`--algo.loss`), with r = pi / pi_old per token and A the advantage, sg = no gradient:

    ppo     L = max(-A*r, -A*clip(r, 1 - 0.2, 1 + 0.2)), token-mean       Schulman et al. 2017
    gspo    the same on one length-normalised ratio per sequence, s = exp(mean_t log r), clipped
            to [1 - 3e-4, 1 + 4e-4] (the paper's: a sequence's mean log-ratio moves far less than a
            token's), seq-mean-token-mean                                 Zheng et al. 2025
    cispo   L = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi, no lower bound and r <= 5
            by default (--algo.clip-high 4.0: TRL's recommended epsilon_high 5.0), token-mean:
            every token keeps its gradient, only its weight is capped     MiniMax-M1 2025
    sapo    L = -(4/tau) * sigmoid(tau * (r - 1)) * A, tau = 1.0 where A > 0, 1.05 elsewhere
            (--algo.sapo-tau-pos, --algo.sapo-tau-neg): a soft gate, no clip; at r = 1 the
            gradient is -A, the policy gradient's, seq-mean-token-mean    Qwen (SAPO) 2025

cispo and sapo agree with TRL's GRPOTrainer (loss_type "cispo", "sapo") on the same tensors
(tests/test_policy_losses_peer.py).

DAPO (Yu et al. 2025) is GRPO with clip-higher (`--algo.clip-high 0.28`), the token-mean loss and
no KL (both defaults here), dynamic sampling (`--algo.dynamic-sampling`: groups whose scores are all
equal are dropped and more prompts sampled until the batch is full, at most
`--algo.max-sampling-rounds` rounds, then it trains on what it kept) and overlong reward shaping
(`--algo.overlong-buffer L`: a penalty rising linearly to `--algo.overlong-penalty` over the last
L tokens before `--rollout.max-tokens`).

With --model.path the learning rate, the temperature and the micro-batch budget default to what
learned on a real model on a 2-core CPU (SmolLM2-135M-Instruct, docs/real-model.md): lr 1e-5,
temperature 0.7 (at 1 a small model's samples are worse than its greedy answers, longer, and it
learned later: one seed each, greedy at step 5 0.21 against 0.40),
1024-token micro-batches (less memory, no slower on a CPU; raise it on a GPU).

Supports: any supported Hugging Face causal LM, jsonl/parquet prompts, rule rewards or
`module:function`, the estimators and losses above, DAPO, several PPO epochs and mini-batches,
checkpoints and resume, colocated or split (reference on its own ranks) placement, and
asynchronous steps (`--trainer.async-steps k`: a rollout group on ranks of its own generates the
next k steps' samples while this one trains, each sample at most k policy versions old, the
engine's log-probs corrected as --algo.rollout-correction says; hflow/recipe_kit/async_rollouts.py).
Not (yet): reward models, DAPO's overlong filtering (masking truncated responses out of the loss),
multi-turn rollouts.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

import hflow
from hflow import algos
from hflow.recipe_kit.config import (ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                          TrainerConfig, by_model)
from hflow.recipe_kit.critic_free import CriticFreeConfig, critic_free_loss, resolve_critic_free
from hflow.default import EMBEDDED
from hflow.layout import concat_rollouts
from hflow.metrics import Timer
from hflow.recipe_kit.set_up import gather, kl_to_reference, set_up, step_metrics
from hflow.recipe_kit.scoring import Rewards, reward_roles
from hflow.recipe_kit.text_batches import prompt_batch
from hflow.validation import ConfigError
from hflow.workers import Actor, Reference, trainable_prompts


@dataclass
class GRPOConfig(CriticFreeConfig):
    norm_by_std: bool = True
    """Divide grpo's advantages by the group's std; --algo.no-norm-by-std is --algo.estimator drgrpo."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose scores are all equal and sample more prompts until the batch is full."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: generation rounds per step at most, the first included; then train on what was kept."""
    overlong_buffer: int = 0
    """DAPO: penalise responses longer than --rollout.max-tokens minus this many tokens (0: off)."""
    overlong_penalty: float = 1.0
    """DAPO: the overlong penalty at --rollout.max-tokens (it rises linearly from 0 over the buffer)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # with --model.path: what learned on SmolLM2-135M-Instruct on this 2-core CPU (docs/real-model.md):
    # lr 1e-5 (1e-6 barely moves a small model in tens of steps), temperature 0.7 (at 1 it learned too,
    # later and with steps 1.5x as long, its responses longer: held-out greedy 0.207 / 0.473 at steps
    # 5 / 10, against 0.395 / 0.412 at 0.7, one seed each), micro-batches of 1024 tokens (5.4 GiB a
    # process against 7.9 at 8192, and no slower there; raise it on a GPU)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-5)), max_tokens_per_micro_batch=by_model(8192, 1024)))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        n=8, max_tokens=by_model(5, 512), temperature=by_model(1.0, 0.7)))
    algo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/grpo"))


def resolve_algo(algo: GRPOConfig, max_tokens: int) -> GRPOConfig:
    """The flags left unset filled in from the estimator and the loss; bad combinations refused."""
    estimator = algo.estimator
    if not algo.norm_by_std:
        if estimator not in ("grpo", "drgrpo"):
            raise ConfigError(f"--algo.no-norm-by-std is --algo.estimator drgrpo; it does not apply to {estimator}")
        estimator = "drgrpo"
    if algo.max_sampling_rounds < 1:
        raise ConfigError(f"--algo.max-sampling-rounds {algo.max_sampling_rounds}: must be >= 1")
    if not 0 <= algo.overlong_buffer <= max_tokens:
        raise ConfigError(f"--algo.overlong-buffer {algo.overlong_buffer}: must be between 0 and "
                         f"--rollout.max-tokens {max_tokens}")
    return resolve_critic_free(dataclasses.replace(algo, estimator=estimator))


def sample(actor, sampler, rewards, cfg: Config, algo: GRPOConfig, step: int, dp: int, rollouts=None):
    """This step's responses and their scores (with DAPO's overlong penalty) and the scorer's
    metrics. With dynamic sampling, only the groups whose scores differ, from as many rounds of
    `data.batch-size` prompts as it takes to fill the batch (at most --algo.max-sampling-rounds).
    With a rollout group (`rollouts`, hflow.recipe_kit.async_rollouts), the batch it generated for this step."""
    n, batch_size = cfg.rollout.n, cfg.data.batch_size
    rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
    kept, kept_scores, metrics = [], [], {}
    for r in range(rounds):
        # a seed per (step, round): a resumed run draws what the uninterrupted one drew
        rollout = cfg.rollout.for_step(step, r, rounds)
        if rollouts is not None:   # generated ahead, while earlier steps trained
            batch, metrics = rollouts.take(step)
        else:
            batch = actor.generate(prompt_batch(next(sampler)), rollout)
        scores, round_metrics = rewards(batch)
        if r == 0:   # the first round's metrics: the policy's reward, unfiltered
            metrics |= round_metrics
        if algo.overlong_buffer:   # DAPO: a soft penalty near the length cap, not a cliff at it
            scores = scores + algos.overlong_penalty(batch["response_mask"].sum(-1), cfg.rollout.max_tokens,
                                                     algo.overlong_buffer, algo.overlong_penalty)
        if not algo.dynamic_sampling:
            return batch, scores, metrics
        # a group whose samples all scored alike has every advantage 0: it only dilutes the batch
        keep = algos.groups_with_varied_scores(scores, torch.arange(len(batch)) // n)
        kept.append(batch[keep])
        kept_scores.append(scores[keep])
        if sum(len(b) for b in kept) >= batch_size * n:
            break
    prompts = trainable_prompts(min(sum(len(b) for b in kept) // n, batch_size), n, cfg.actor.mini_batch_size, dp)
    metrics |= {"dapo/extra_rounds": float(r), "dapo/kept_groups": float(prompts),
                "dapo/short_batch": float(prompts < batch_size)}   # the cap was hit: fewer prompts than asked
    return concat_rollouts(kept)[:prompts * n], torch.cat(kept_scores)[:prompts * n], metrics


def main(cluster: hflow.Cluster, cfg: Config):
    algo = resolve_algo(cfg.algo, cfg.rollout.max_tokens)
    # split: the models that only read (reference, reward model) on ranks of their own
    sets = [["actor"], (["ref"] if algo.kl_coef > 0 else []) + reward_roles(cfg.reward)]
    if algo.dynamic_sampling and cfg.trainer.async_steps:
        raise ConfigError("--algo.dynamic-sampling samples more prompts until the batch is full, which a pipeline "
                          "of --trainer.async-steps cannot know ahead: use one or the other")
    # every input checked, then the warm-up; a rollout group of its own with --trainer.async-steps
    setup = set_up(cluster, cfg, sets, algo="grpo", default=EMBEDDED, asynchronous=True)
    placement, dp = setup.placement, len(setup.placement["actor"])
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=placement["actor"])
    ref = cluster.spawn(Reference, setup.actor_cfg, ranks=placement["ref"]) if "ref" in placement else None
    rollouts = setup.rollouts(cluster, actor)   # None: the actor's own engine generates
    run = setup.run(actor, rewards, trained={"actor": actor}, state={"rollouts": rollouts} if rollouts else None)
    # a KL in the reward needs the sampling policy's log-probs before the update
    old = setup.old_log_probs(kl_in_reward=ref is not None and algo.kl_in_reward)
    loss_fn = functools.partial(critic_free_loss, algo=algo, correction=old.correction)
    estimator = algos.estimator(algo.estimator)

    timer, temperature = Timer(), cfg.rollout.temperature
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                batch, scores, metrics = sample(actor, setup.sampler, rewards, cfg, algo, step, dp, rollouts)
            if len(batch):   # (dynamic sampling may keep no group at all: nothing to learn this step)
                mask = batch["response_mask"]
                with timer("log_probs"):
                    refs = [ref.log_probs.future(batch, temperature)] if ref else []
                    batch = gather(batch, refs + old.pending(actor, batch, temperature))
                token_rewards = algos.scores_to_token_rewards(scores, mask)   # the score lands on the last token
                if ref:   # KL of the sampling policy to the reference (on-policy: the engine's log-probs of it)
                    kl, metrics["kl/mean"] = kl_to_reference(batch)
                    if algo.kl_in_reward:   # every token pays for straying from the reference
                        token_rewards = token_rewards - algo.kl_coef * kl
                # the group (or the batch) is the baseline: no critic
                groups = torch.arange(len(batch)) // cfg.rollout.n
                batch["advantages"] = estimator(token_rewards, mask, groups, gamma=algo.gamma)
                with timer("update"):
                    metrics |= actor.update(batch, loss_fn, loss_agg=algo.loss_agg)[0]
            if rollouts:   # the new weights to the rollout group, behind the generations already issued
                rollouts.push(step)
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
