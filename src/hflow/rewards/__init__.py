"""Verifiable rewards: score functions, a registry by name, and batch scoring.

A score function is ``fn(response: str, ground_truth, **extra) -> float | dict``: the response is
the generated completion (prompt excluded), the ground truth is the dataset's answer column, and
``extra`` holds the row's other columns (a scorer ignores keys it does not know). A dict return
holds ``"score"`` plus extra numeric metrics, averaged into the batch metrics.

Built in (``get_reward_fn(name)``):

- ``arithmetic``: the default task's checker, 1 when the completion starts with the right number.
- ``gsm8k`` / ``gsm8k_flexible``: the ``#### 42`` answer / the last number in the response.
- ``math``: the last ``\\boxed{}``, normalised, compared as strings then with sympy.
- ``countdown``: an ``<answer>`` equation using the given numbers once each, reaching the target.
- ``code``: the fraction of the ground truth's tests (asserts) that the response's Python passes,
  run in a sandbox (``hflow.rewards.code``).

A user's own function is named ``"package.module:function"``. Scoring a batch runs it in worker
processes with a per-item timeout (``score_batch``); a function that raises or hangs scores 0 and
is counted in the metrics.
"""
import importlib
from typing import Any, Callable, Union

from hflow.rewards.pool import RewardConfig, RewardPool, ScoredBatch, Scorer, score_batch

__all__ = [
    "ScoreFn", "get_reward_fn", "register_reward_fn", "reward_fn_names", "inline_safe",
    "RewardConfig", "RewardPool", "ScoredBatch", "Scorer", "score_batch",
]

ScoreFn = Callable[..., Union[float, dict]]

# name -> "module:function"; imported on first use so that `import hflow.rewards` stays cheap
# (the math scorer pulls in sympy).
_REGISTRY: dict[str, Union[str, ScoreFn]] = {
    "arithmetic": "hflow.rewards.arithmetic:arithmetic_score",
    "gsm8k": "hflow.rewards.gsm8k:gsm8k_score",
    "gsm8k_flexible": "hflow.rewards.gsm8k:gsm8k_flexible_score",
    "math": "hflow.rewards.math_answer:math_score",
    "countdown": "hflow.rewards.countdown:countdown_score",
    "code": "hflow.rewards.code:code_score",
}


def inline_safe(fn: ScoreFn) -> ScoreFn:
    """Mark a score function as fast and sure to return (no sympy, no eval, no I/O): batches
    of it are scored in the calling process, without worker processes or a timeout."""
    fn.inline_safe = True
    return fn


def register_reward_fn(name: str, fn: Union[ScoreFn, str]) -> None:
    """Make ``fn`` (a function or a ``"module:function"`` string) available as ``name``."""
    _REGISTRY[name] = fn


def reward_fn_names() -> list[str]:
    return sorted(_REGISTRY)


def _import_spec(spec: str) -> ScoreFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = ("; torchrun does not put the working directory on sys.path: run with PYTHONPATH=. "
                "(or the module's folder), or pip install your package") \
            if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0] else ""
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({e}){hint}") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: module {module_name!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def get_reward_fn(name: Union[str, ScoreFn]) -> ScoreFn:
    """A score function by registered name (``"gsm8k"``) or ``"module:function"``; a callable
    is returned as is."""
    if callable(name):
        return name
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return _import_spec(entry) if isinstance(entry, str) else entry
    if ":" in name:
        return _import_spec(name)
    raise ValueError(
        f"unknown reward function {name!r}: use one of {', '.join(reward_fn_names())}, "
        "or 'package.module:function' for your own (set it with --reward.fn)"
    )
