"""ReMax: REINFORCE with the greedy response as the baseline (Li et al. 2023) — no critic.

    torchrun --nproc-per-node 2 recipes/remax.py                    # the embedded default task
    torchrun --nproc-per-node 4 recipes/remax.py --algo.kl-coef 0.001 --trainer.placement split
    torchrun --nproc-per-node 2 recipes/remax.py --reward.model default       # the default reward model
    torchrun --nproc-per-node 8 recipes/remax.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \
        --data.chat --reward.fn gsm8k --algo.kl-coef 0.001
    torchrun ... recipes/remax.py --help                            # every flag, grouped

Each step: for each of `data.batch-size` prompts, sample `rollout.n` responses and decode one
greedy response (temperature 0), all in one engine call with the actor's current weights;
score them all; give every token of sample i the advantage A_i = s_i - s_greedy(prompt of i)
(minus beta * the KL to the reference from that token on, with `--algo.kl-coef`: verl's KL in
the reward); update the actor with the PPO clipped loss on the sampled responses. On-policy
(the default: one epoch, one mini-batch) the ratio is 1 and this is the paper's REINFORCE.
The greedy responses are only the baseline: never trained on, logged as reward/greedy_mean.

Supports: any supported Hugging Face causal LM, jsonl/parquet prompts, rule rewards or
`module:function`, a reward model in the loop (`--reward.model`, alone or added to the rule with
`--reward.model-weight`; held-out accuracy stays the rule's), a k1 KL penalty in the reward,
several PPO epochs and mini-batches, checkpoints and resume, colocated or split placement
(reference and reward model on their own ranks), export.
Not (yet): the paper's clipping of s - b to +-5, multi-turn.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch

import hflow
from hflow import algos
from hflow.recipe_kit.config import (ActorConfig, OffPolicyConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                          TrainerConfig, by_model)
from hflow.default import EMBEDDED
from hflow.metrics import Timer
from hflow.recipe_kit.set_up import gather, kl_to_reference, set_up, step_metrics
from hflow.recipe_kit.scoring import Rewards, reward_roles
from hflow.recipe_kit.text_batches import prompt_batch
from hflow.workers import Actor, Reference, split_greedy


@dataclass
class ReMaxConfig(OffPolicyConfig):
    kl_coef: float = 0.0
    """beta: weight of the k1 KL penalty to the reference in the reward (0: no reference model at all; verl's example uses 0.001, the paper 0.05)."""
    clip_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_low (inactive on-policy)."""
    clip_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_high (inactive on-policy)."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How the loss averages over tokens and sequences (token-mean: the paper's and verl's)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-6)), max_tokens_per_micro_batch=8192))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4, max_tokens=by_model(5, 512)))
    algo: ReMaxConfig = field(default_factory=ReMaxConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/remax"))


def remax_advantages(scores, greedy_scores, mask, kl=None, kl_coef: float = 0.0):
    """A_t = s_i - b_i - beta * sum_{t' >= t} kl_t' on every token t of sample i, where b_i is
    the greedy score of i's prompt (`greedy_scores` one per prompt; a prompt's samples are
    adjacent rows) and the KL term is there only with `kl_coef` > 0."""
    per_sample = len(scores) // len(greedy_scores)
    advantages = algos.remax_advantages(scores, greedy_scores.repeat_interleave(per_sample), mask)
    if kl_coef > 0:
        # -beta*kl is a reward on each token (verl), so a token's return holds the penalty of all that follows it
        kl_to_go, _ = algos.gae_advantages(-kl_coef * kl, torch.zeros_like(kl), mask, 1.0, 1.0)
        advantages = advantages + kl_to_go
    return advantages


def remax_loss(log_probs, mb, entropy=None, *, algo: ReMaxConfig, correction: algos.RolloutCorrection):
    """The PPO clipped surrogate on the ReMax advantages (verl); on-policy it is REINFORCE."""
    weights, corrected = correction(mb)   # the engine sampled: weighted towards the trainer's policy
    loss, metrics = algos.policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                                      algo.clip_low, algo.clip_high, agg=algo.loss_agg, is_weights=weights)
    return loss, metrics | corrected


def main(cluster: hflow.Cluster, cfg: Config):
    algo = cfg.algo
    # split: the models that only read (reference, reward model) on ranks of their own
    sets = [["actor"], (["ref"] if algo.kl_coef > 0 else []) + reward_roles(cfg.reward)]
    setup = set_up(cluster, cfg, sets, algo="remax", default=EMBEDDED)   # every input checked, then the warm-up
    placement, sampler = setup.placement, setup.sampler
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=placement["actor"])
    ref = cluster.spawn(Reference, setup.actor_cfg, ranks=placement["ref"]) if "ref" in placement else None
    # held-out accuracy is the rule's, also when a reward model (a proxy) gives the training score
    run = setup.run(actor, rewards, trained={"actor": actor},
                    notes="each prompt's baseline is the score of its greedy response, sampled beside the others")
    # the KL is in the reward: it needs the sampling policy's log-probs before the update
    old = setup.old_log_probs(kl_in_reward=ref is not None)
    loss_fn = functools.partial(remax_loss, algo=algo, correction=old.correction)

    timer, temperature = Timer(), cfg.rollout.temperature
    for step in run.steps():
        with timer("step"):
            with timer("generate"):   # the greedy baseline comes from the same weights, in the same engine call
                rollout = cfg.rollout.for_step(step)
                batch, greedy = split_greedy(actor.generate(prompt_batch(next(sampler)), rollout, with_greedy=True))
            scores, metrics = rewards(batch)
            greedy_scores, _ = rewards(greedy)
            mask = batch["response_mask"]
            with timer("log_probs"):
                refs = [ref.log_probs.future(batch, temperature)] if ref else []
                batch = gather(batch, refs + old.pending(actor, batch, temperature))
            kl = None
            if ref:
                kl, metrics["kl/mean"] = kl_to_reference(batch)
            # the greedy response's score is the baseline: it depends on the prompt, not on the
            # sample, so the gradient stays unbiased, and no critic has to learn it
            batch["advantages"] = remax_advantages(scores, greedy_scores, mask, kl, algo.kl_coef)
            with timer("update"):
                metrics |= actor.update(batch, loss_fn, loss_agg=algo.loss_agg)[0]
        metrics["reward/greedy_mean"] = greedy_scores.mean().item()
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
