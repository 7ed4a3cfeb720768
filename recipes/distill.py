"""On-policy distillation: the student samples, a frozen teacher scores every sampled position, and
the student moves towards the teacher's distribution where the student itself goes.

    torchrun --nproc-per-node 2 recipes/distill.py --model.path smollm2-135m-instruct \
        --distill.teacher outputs/grpo/actor_hf --data.task rg:chain_sum \
        --data.task-args min_terms=2 max_terms=2 min_digits=1 max_digits=2
    torchrun ... recipes/distill.py ... --distill.divergence jsd --distill.jsd-beta 0.5   # GKD
    torchrun ... recipes/distill.py ... --distill.reward-weight 0.5   # plus GRPO on the task reward
    torchrun ... recipes/distill.py --help                              # every flag, grouped

Each step: sample `rollout.n` responses for each of `data.batch-size` prompts with the student's
current weights; run the student and the teacher over them (the teacher sits on the student's
ranks, hflow.workers.teacher, so its whole next-token distribution is at hand); update the student
on the token mean of the per-token divergence over every sampled position t (p_s the student's
distribution, p_t the teacher's, both at temperature 1, the models' own):

    reverse_kl (default)  D_t = sum_v p_s(v) (log p_s(v) - log p_t(v))     mode-seeking: the student
                                                                           stops putting mass where
                                                                           the teacher puts none
    jsd                   GKD's generalised JSD with --distill.jsd-beta     Agarwal et al. 2024
                          (0: KL(teacher || student), 1: reverse KL)

    L = token-mean_t D_t  +  w * L_ppo(A)        w = --distill.reward-weight (0: no reward term)

The divergence is exact over the vocabulary and differentiated through every logit (as TRL's
GKDTrainer; verl, Thinking Machines and slime use instead the sampled token's log-ratio
log p_s(x_t) - log p_t(x_t) as a per-token advantage, its one-sample estimate, logged here as
actor/sampled_kl beside actor/divergence). With w > 0, A is GRPO's group-normalised advantage of
the task score (the score on the last token, (s - mean_g) / (std_g + eps)), through the clipped
policy loss at ratio 1 (on-policy). Held out: eval/reward_mean (greedy task score, as every
recipe) and eval/teacher_kl, the mean per-token divergence of the student's greedy responses
from the teacher, at step 0, every --trainer.eval-every steps and at the end.

The teacher is any Hugging Face causal LM with the student's tokenizer (a larger model of the
same family, or the student after RL, as in docs/real-model.md). Supports what recipes/grpo.py's
synchronous colocated runs do (data, rewards, checkpoints, export). Not: a teacher on ranks of
its own (its full distribution would have to cross), asynchronous steps, teachers with another
tokenizer (GOLD's token alignment), off-policy (several epochs) with a reward term.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch

import hflow
from hflow import algos
from hflow.default import EMBEDDED
from hflow.metrics import Timer
from hflow.recipe_kit.config import (ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                                     TrainerConfig, by_model)
from hflow.recipe_kit.evaluation import evaluate
from hflow.recipe_kit.scoring import Rewards, reward_roles
from hflow.recipe_kit.set_up import set_up, step_metrics
from hflow.recipe_kit.teacher import teacher_dir
from hflow.recipe_kit.text_batches import prompt_batch
from hflow.validation import ConfigError
from hflow.workers import StudentWithTeacher


@dataclass
class DistillConfig:
    """The teacher and the signal (--distill.*)."""

    teacher: str = ""
    """The frozen teacher: a Hugging Face directory, a Hub id or a fetched name, with the student's tokenizer (required)."""
    divergence: Literal[tuple(algos.DIVERGENCES)] = "reverse_kl"
    """Per-token divergence over the vocabulary: reverse_kl, KL(student || teacher), or jsd (GKD's generalised JSD)."""
    jsd_beta: float = 0.5
    """jsd's beta in [0, 1]: the teacher's weight in the mixture (0: KL(teacher || student), 1: the reverse KL)."""
    reward_weight: float = 0.0
    """Weight of GRPO's clipped policy loss on the task reward beside the divergence (0: distillation alone)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # with --model.path: recipes/grpo.py's real-model defaults, so that the two compare from one start
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-5)), max_tokens_per_micro_batch=by_model(8192, 1024)))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        n=8, max_tokens=by_model(5, 512), temperature=by_model(1.0, 0.7)))
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=150, eval_every=50, output_dir="outputs/distill"))


def main(cluster: hflow.Cluster, cfg: Config):
    distill = cfg.distill
    if cfg.trainer.async_steps:
        raise ConfigError("--trainer.async-steps: this recipe runs synchronously (the teacher reads the student's "
                          "samples of this step)")
    # the teacher is on the actor's ranks (hflow.workers.teacher); a reward model may sit apart
    setup = set_up(cluster, cfg, [["actor"], reward_roles(cfg.reward)], algo="grpo", default=EMBEDDED)
    teacher = teacher_dir(distill.teacher, setup.tokenizer)
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, setup.placement.get("reward"))
    student = cluster.spawn(StudentWithTeacher, setup.actor_cfg, teacher, distill.divergence, distill.jsd_beta,
                            ranks=setup.placement["actor"])

    def teacher_kl(responses) -> dict[str, float]:   # the held-out greedy responses' distance to the teacher
        signals = student.divergence(responses)
        return {"eval/teacher_kl": algos.masked_mean(signals["divergence"], responses["response_mask"]).item()}

    held_out = functools.partial(evaluate, student, setup.val, setup.tokenizer, rewards.rule, cfg.rollout,
                                 cfg.trainer.eval_size, batch_figures=teacher_kl)
    run = setup.run(student, rewards, trained={"actor": student}, evaluate_fn=held_out,
                    notes=f"teacher {teacher} ({distill.divergence}), colocated with the student")
    loss_fn = functools.partial(algos.distill_loss, reward_weight=distill.reward_weight)
    grpo = algos.estimator("grpo")

    timer = Timer()
    for step in run.steps():
        with timer("step"):
            with timer("generate"):   # 1. the student samples
                batch = student.generate(prompt_batch(next(setup.sampler)), cfg.rollout.for_step(step))
                scores, metrics = rewards(batch)   # the task score: logged, and the reward term's
            if distill.reward_weight > 0:   # 2. (optional) GRPO's advantages of the task score
                mask = batch["response_mask"]
                groups = torch.arange(len(batch)) // cfg.rollout.n
                batch["advantages"] = grpo(algos.scores_to_token_rewards(scores, mask), mask, groups)
            with timer("update"):   # 3. the teacher scores every sampled position; the student moves towards it
                metrics |= student.update(batch, loss_fn, loss_agg="token-mean")[0]
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
