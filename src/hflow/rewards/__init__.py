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
  run in the code sandbox (``hflow.rewards.code``, on ``hflow.sandbox``).

A user's own function is named ``"package.module:function"``. Scoring a batch runs it in worker
processes with a per-item timeout (``score_batch``); a function that raises or hangs scores 0 and
is counted in the metrics.
"""
from hflow.rewards.pool import RewardPool, ScoredBatch, score_batch
from hflow.rewards.registry import ScoreFn, get_reward_fn, inline_safe, register_reward_fn, reward_fn_names
from hflow.rewards.scorer import DEFAULT_RULE, RewardConfig, Scorer

__all__ = [
    "ScoreFn", "get_reward_fn", "register_reward_fn", "reward_fn_names", "inline_safe",
    "RewardConfig", "RewardPool", "ScoredBatch", "Scorer", "score_batch", "DEFAULT_RULE",
]
