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

Some defaults depend on the model. The embedded default (a few-million-parameter model on a toy
task, `--model.path` empty) learns with a large learning rate and answers in a few tokens; a
real model given by `--model.path` wants the usual values (actor lr ~1e-6, critic ~1e-5,
hundreds of new tokens). A recipe writes such a default as `by_model(embedded, given)`, which
`--help` shows as both values; `hflow.launch` resolves it once the flags are parsed, so `main`
sees plain numbers (hflow.by_model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hflow.by_model import by_model, resolve_defaults
from hflow.data import DataConfig
from hflow.metrics import LoggingConfig
from hflow.rewards import RewardConfig
from hflow.workers import (ActorConfig, CriticConfig, FSDPConfig, OptimConfig, RewardModelConfig,
                           RolloutConfig)

__all__ = ["ModelConfig", "RolloutConfig", "TrainerConfig", "DataConfig", "RewardConfig",
           "ActorConfig", "CriticConfig", "RewardModelConfig", "OptimConfig", "FSDPConfig",
           "LoggingConfig", "by_model", "resolve_defaults"]


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face directory of the policy (config, safetensors, tokenizer); empty: the embedded default model, built here and warmed up with supervised learning (cached)."""
    default_size: Literal["tiny", "default", "25m"] = "default"
    """Size of the embedded default model (used when --model.path is empty)."""
    default_seed: int = 0
    """Seed of the embedded default model and of its warm-up."""


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)
