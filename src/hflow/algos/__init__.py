"""The math of RL on language models: advantages, losses, KL estimators and controllers.

Pure functions on `[batch, response_len]` tensors with a 0/1 response `mask` (1 = a token the
policy generated and is trained on; 0 = padding, or tool/environment output inside a multi-turn
response). Conventions shared by every function here:

- Masked-out positions never influence a result, even if they hold NaN or inf: values there are
  selected away with `torch.where` (not multiplied by 0, which would keep a NaN), and outputs are
  0 there. Gradients at masked-out positions are exactly 0.
- A mean over nothing (an all-zero mask) is 0, so an all-padding micro-batch adds nothing
  instead of a NaN.
- Advantage estimators run without autograd and return detached tensors.
- Losses return `(loss, metrics)`: `loss` a 0-dim tensor carrying the gradient, `metrics` a dict
  of plain Python floats (ready for logging; on GPU `.item()` costs one device sync per call).
- `gamma`, `lam`, clip ranges and coefficients are Python floats.

    masked.py       masked_mean, masked_whiten, aggregate_loss, explained_variance
    advantages.py   the estimators (GAE, GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++, DAPO's filter and
                    overlong penalty) and ESTIMATORS, the registry recipes pick from by name
    losses.py       kl_penalty, the policy losses (POLICY_LOSSES: ppo, gspo, cispo, sapo), value_loss, nll_loss
    correction.py   rollout correction: the engine/trainer log-prob gap and its importance weights
    kl_control.py   the fixed and adaptive KL coefficient controllers
    lagrangian.py   Safe-RLHF's Lagrange multiplier and the Lagrangian's advantage
    pairs.py        reward and cost models' losses on preference pairs; DPO's and IPO's
    distill.py      on-policy distillation's per-token divergences (DIVERGENCES: reverse_kl, jsd) and loss
    turn_credit.py  per-turn credit over multi-turn trajectories: pad_turn_rewards, turn_returns, turn_advantages
    registry.py     the name -> function tables (Registry) the registries above are

verl's `trainer/ppo/core_algos.py` is the model for names and formulas; this is our own code.
"""
from hflow.algos.advantages import (ESTIMATORS, estimator, gae_advantages, grpo_advantages,
                                    groups_with_varied_scores, overlong_penalty, register_estimator,
                                    reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                                    remax_advantages, rloo_advantages, scores_to_token_rewards)
from hflow.algos.correction import (CORRECTION_LEVELS, CORRECTION_MODES, RolloutCorrection, importance_weights,
                                    mismatch_metrics)
from hflow.algos.distill import DIVERGENCES, distill_loss, token_divergence
from hflow.algos.kl_control import AdaptiveKLController, FixedKLController
from hflow.algos.lagrangian import LagrangeMultiplier, lagrangian_advantages, update_log_lambda
from hflow.algos.losses import (KL_KINDS, POLICY_LOSSES, cispo_policy_loss, entropy_from_logits, gspo_policy_loss,
                                kl_penalty, nll_loss, policy_loss, policy_loss_fn, register_policy_loss,
                                sapo_policy_loss, value_loss)
from hflow.algos.masked import AGG_MODES, aggregate_loss, explained_variance, masked_mean, masked_whiten
from hflow.algos.pairs import bradley_terry_loss, cost_model_loss, pair_loss, pair_metrics
from hflow.algos.pairs import DPO_LOSSES, dpo_loss, dpo_metrics, dpo_pair_loss, sequence_log_probs
from hflow.algos.turn_credit import pad_turn_rewards, turn_advantages, turn_returns

__all__ = [
    "masked_mean", "masked_whiten", "aggregate_loss", "explained_variance", "AGG_MODES",
    "scores_to_token_rewards", "gae_advantages", "grpo_advantages", "rloo_advantages", "remax_advantages",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "groups_with_varied_scores",
    "overlong_penalty", "ESTIMATORS", "register_estimator", "estimator",
    "kl_penalty", "KL_KINDS", "policy_loss", "gspo_policy_loss", "cispo_policy_loss", "sapo_policy_loss",
    "value_loss", "entropy_from_logits",
    "nll_loss", "POLICY_LOSSES", "register_policy_loss", "policy_loss_fn",
    "RolloutCorrection", "importance_weights", "mismatch_metrics", "CORRECTION_MODES", "CORRECTION_LEVELS",
    "FixedKLController", "AdaptiveKLController",
    "LagrangeMultiplier", "update_log_lambda", "lagrangian_advantages",
    "bradley_terry_loss", "cost_model_loss", "pair_metrics", "pair_loss",
    "dpo_loss", "dpo_metrics", "dpo_pair_loss", "sequence_log_probs", "DPO_LOSSES",
    "pad_turn_rewards", "turn_returns", "turn_advantages",
    "DIVERGENCES", "token_divergence", "distill_loss",
]
