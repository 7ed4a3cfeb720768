"""The embedded default: what a recipe runs without --model.path. A small Qwen2 model and
tokenizer hflow builds itself (nothing is downloaded), its supervised warm-up on the arithmetic
task, the reward and cost models that judge it, and the safety task's refusing policy; each is
built once and cached (cache.py).

    model.py      the tokenizer, config and random weights (deterministic from a seed)
    warm_up.py    the policy supervised until it answers half the held-out problems
    judges.py     the reward model (right over wrong answers) and the safety task's cost model
    refusing.py   Safe-RLHF's starting policy, which refuses a random fifth of all problems
    tool_use.py   the agent task's starting policy, which calls its calculator on some products
    cache.py      where they live, and how each is built exactly once

The library never imports this package: a recipe hands `EMBEDDED` to `hflow.recipe_kit.set_up.set_up`,
which asks it for a model only when --model.path is empty.
"""
from __future__ import annotations

from pathlib import Path

from hflow.default.judges import DEFAULT_JUDGES, default_pair_rows, default_reward_model, default_reward_model_dir
from hflow.default.model import build_default, default_model_dir
from hflow.default.refusing import refusing_policy
from hflow.default.tool_use import tool_calling_policy
from hflow.default.warm_up import default_policy, default_policy_dir

__all__ = ["EMBEDDED", "EmbeddedDefault", "DEFAULT_JUDGES", "build_default", "default_model_dir", "default_policy",
           "default_policy_dir", "default_pair_rows", "default_reward_model", "default_reward_model_dir",
           "refusing_policy", "tool_calling_policy"]


class EmbeddedDefault:
    """The embedded default as `hflow.recipe_kit.set_up.set_up` asks for it (`model` is the run's
    ModelConfig: --model.default-size, --model.default-seed)."""

    def base_model(self, model) -> Path:
        """The untrained model: its tokenizer is the run's (cheap: built once, in seconds)."""
        return default_model_dir(model.default_size, model.default_seed)

    def policy(self, cluster, model) -> Path:
        """The warmed-up policy RL starts from (trained on `cluster` the first time)."""
        return default_policy(cluster, model.default_size, model.default_seed)

    def judge(self, cluster, kind: str, model) -> Path:
        """The reward model (kind "reward") or cost model ("cost") for this policy."""
        return default_reward_model(cluster, kind, size=model.default_size, seed=model.default_seed)


EMBEDDED = EmbeddedDefault()
