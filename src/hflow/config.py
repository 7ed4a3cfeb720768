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
`--help` shows as both values, and its `main` starts with `cfg = resolve_defaults(cfg)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

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


# ---------------------------------------------------------------- defaults that depend on the model


class _ByModel:
    """A default with one value for the embedded default model and one for a model given by
    --model.path. It *is* the embedded value (a float or int subclass), so a recipe that never
    resolves it still runs as before; `resolve_defaults` replaces it by a plain number."""

    def __new__(cls, embedded, given):
        self = super().__new__(cls, embedded)
        self.embedded, self.given = embedded, given
        return self

    def __repr__(self):   # what --help shows as the default
        return f"{self.embedded!r} with the embedded default model, {self.given!r} with --model.path"

    __str__ = __repr__

    def __reduce__(self):
        return by_model, (self.embedded, self.given)


class _ByModelFloat(_ByModel, float):
    pass


class _ByModelInt(_ByModel, int):
    pass


def by_model(embedded: float, given: float):
    """A default that is `embedded` when --model.path is empty and `given` otherwise."""
    return (_ByModelInt if isinstance(embedded, int) else _ByModelFloat)(embedded, given)


def resolve_defaults(cfg):
    """`cfg` (a recipe's Config, with a `model: ModelConfig`) with every `by_model` default
    replaced by its value for the model in use; what a flag set is left as it is."""
    given = bool(cfg.model.path)

    def resolve(value):
        if isinstance(value, _ByModel):
            return value.given if given else value.embedded
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: resolve(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        return value

    return resolve(cfg)
