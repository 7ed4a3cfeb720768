"""The configuration a recipe is made of: dataclasses that tyro turns into grouped flags.

Each part lives next to the code it configures and is re-exported here, so that a recipe
imports its whole configuration from one place:

    --model.*    ModelConfig      which policy (or the embedded default)
    --data.*     DataConfig       prompts (hflow.data)
    --reward.*   RewardConfig     how responses are scored (hflow.rewards)
    --actor.*    ActorConfig      the policy's training (hflow.workers)
    --critic.*   CriticConfig     the value model's training (hflow.workers)
    --rollout.*  RolloutConfig    sampling and the generation engine (hflow.workers)
    --trainer.*  TrainerConfig    steps, evaluation, checkpoints, logging, placement
    --algo.*     the recipe's own; an RL recipe's inherits OffPolicyConfig (the old log-probs
                 and the rollout correction)

Some defaults depend on the model. The embedded default (a few-million-parameter model on a toy
task, `--model.path` empty) learns with a large learning rate and answers in a few tokens; a
real model given by `--model.path` wants the usual values (actor lr ~1e-6, critic ~1e-5,
hundreds of new tokens). A recipe writes such a default as `by_model(embedded, given)`, which
`--help` shows as both values; `hflow.launch` resolves it once the flags are parsed, so `main`
sees plain numbers (hflow.model_defaults).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hflow.model_defaults import by_model, resolve_defaults
from hflow.data import DataConfig
from hflow.metrics import LoggingConfig
from hflow.rewards import RewardConfig
from hflow.workers import (ActorConfig, CriticConfig, FSDPConfig, OptimConfig, RewardModelConfig,
                           RolloutConfig)

__all__ = ["ModelConfig", "RolloutConfig", "TrainerConfig", "DataConfig", "RewardConfig",
           "ActorConfig", "CriticConfig", "RewardModelConfig", "OptimConfig", "FSDPConfig",
           "LoggingConfig", "OffPolicyConfig", "by_model", "resolve_defaults"]


@dataclass
class ModelConfig:
    path: str = ""
    """The policy: a Hugging Face directory (config, safetensors, tokenizer), a Hub id (org/name), a .gguf file (converted once to fp32, cached) or a fetched name (python -m hflow.pretrained list); empty: the embedded default model, built here and warmed up with supervised learning (cached)."""
    default_size: Literal["tiny", "default", "25m"] = "default"
    """Size of the embedded default model (used when --model.path is empty)."""
    default_seed: int = 0
    """Seed of the embedded default model and of its warm-up."""


@dataclass
class OffPolicyConfig:
    """The --algo.* flags of every RL recipe's policy update on samples from the engine (the base
    of each recipe's algorithm config; hflow.recipe_kit.set_up.OldLogProbs resolves them)."""
    old_log_probs: Literal["auto", "recompute", "rollout"] = "auto"
    """Old log-probs (for a KL in the reward, an off-policy update, or the rollout correction): a forward pass of the actor (recompute), the engine's own (rollout), or auto: the engine's when the actor computes in fp32 (then they are equal; in bf16 they are not) and no correction is on. An on-policy update with neither needs none."""
    rollout_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Weight each sampled token by pi_trainer / pi_engine (hflow.algos.correction): tis truncates the weight at the cap, mis drops samples beyond it, none takes the ratio as 1; auto: tis when the actor computes in bf16/fp16 (the engine's log-probs differ), none in fp32."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """The ratio per token, or one per response (the product over its tokens)."""
    rollout_correction_cap: float = 2.0
    """The cap of the importance weight (tis: truncated to it; mis: dropped above it)."""


@dataclass
class TrainerConfig:
    steps: int = 20
    """RL steps (one batch of prompts each)."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, checkpoints and the exported model go."""
    eval_every: int = 0
    """Evaluate on the held-out prompts every this many steps (0: only before and after training)."""
    eval_size: int = 500
    """Held-out prompts per evaluation (at most the size of the held-out split)."""
    save_every: int = 0
    """Write a checkpoint every this many steps (0: never)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir/checkpoints."""
    max_skipped_steps: int = 10
    """Stop the run once more optimizer steps than this were skipped for a non-finite loss or gradient."""
    overwrite: bool = False
    """Replace an earlier run in output_dir (its metrics, checkpoints and export); without it a used output_dir is refused."""
    export: bool = True
    """Export the final actor as a Hugging Face directory (output_dir/actor_hf)."""
    placement: str = "colocate"
    """colocate (every model on every rank), split (the recipe's two natural sets of models, each on ranks of its own: the actor's side and the other side; the recipe's docstring says which), standalone (every model on ranks of its own), auto (the planner picks for this machine and logs why), or a SPEC of colocated sets of the run's models and their ranks, e.g. actor,ref:0-1;reward:2 (a wrong SPEC is refused with the run's models listed)."""
    async_steps: int = 0
    """Asynchronous RL (recipes/grpo.py, recipes/ppo.py, recipes/agent.py): generate the samples of the next k steps on a rollout group of ranks of its own while this step trains, so a sample is at most k policy versions old (0: synchronous; the rollout group is then used only if the placement names it). Needs --trainer.placement split, standalone, auto (the planner sizes the training and rollout groups) or a SPEC with a rollout set; the engine's log-probs are then the behaviour policy, corrected by --algo.rollout-correction (auto: tis)."""
    partial_rollouts: bool = False
    """With --trainer.async-steps: when the actor pushes new weights, the generation running takes them between two engine steps and continues each response on them (its KV recomputed), instead of finishing on the old ones first; each token records its policy version. The actor then waits one engine step, not a whole generation, for the push; runs no longer repeat bit for bit (where the weights change depends on timing). --rollout.tp-size 1 only."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
