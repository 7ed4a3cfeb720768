"""hflow: PyTorch-native RL for language models (the HybridFlow design on plain PyTorch).

The public API is re-exported here lazily, so that `import hflow` stays cheap and a recipe
imports only what it uses.
"""
import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "launch": "hflow.runtime.launcher",
    "Cluster": "hflow.runtime.controller",
    "WorkerGroup": "hflow.runtime.controller",
    "RemoteError": "hflow.runtime.controller",
    "Batch": "hflow.batch",
    "DataConfig": "hflow.data",
    "RewardConfig": "hflow.rewards",
    "Scorer": "hflow.rewards",
    "Future": "hflow.runtime.controller",
    "make_mesh": "hflow.distributed.parallel",
    "Actor": "hflow.workers",
    "Reference": "hflow.workers",
    "Critic": "hflow.workers",
    "RewardModel": "hflow.workers",
}
_SUBMODULES = {"algos", "rewards", "data", "engine", "workers", "metrics", "checkpoint",
               "placement", "planner", "runtime", "distributed", "recipe_kit"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"hflow.{name}")
    raise AttributeError(f"module 'hflow' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_SUBMODULES])
