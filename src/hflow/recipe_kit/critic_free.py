"""The critic-free family's --algo.* flags and loss, one copy for the recipes that share them
(recipes/grpo.py, recipes/agent.py): the estimator over a prompt's n samples, the clipped policy
loss, and the KL to the reference in the loss or in the reward.

    algo = resolve_critic_free(cfg.algo)          # the flags left unset, from the estimator and loss
    loss_fn = functools.partial(critic_free_loss, algo=algo, correction=old.correction)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from hflow import algos
from hflow.recipe_kit.config import OffPolicyConfig
from hflow.validation import ConfigError

Estimator = Literal[tuple(algos.ESTIMATORS)]   # grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline
PolicyLoss = Literal[tuple(algos.POLICY_LOSSES)]   # ppo, gspo, cispo, sapo
AggMode = Literal[algos.AGG_MODES]
KLKind = Literal[algos.KL_KINDS]
# (clip_low, clip_high, loss_agg) of each loss when the flags leave them unset (None: no such bound)
LOSS_DEFAULTS = {"ppo": (0.2, 0.2, "token-mean"), "gspo": (3e-4, 4e-4, "seq-mean-token-mean"),
                 "cispo": (None, 4.0, "token-mean"), "sapo": (None, None, "seq-mean-token-mean")}
# the losses' own flags: the loss's keyword argument -> the --algo.* field that holds it
LOSS_FLAGS = {"sapo": {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"}}
# where each estimator's paper puts the KL to the reference: in the reward (k1 per token) or the loss
KL_IN_REWARD = {"grpo": False, "drgrpo": False, "rloo": True, "reinforce_pp": True, "reinforce_pp_baseline": True}


@dataclass
class CriticFreeConfig(OffPolicyConfig):
    estimator: Estimator = "grpo"
    """Advantage estimator over a prompt's n samples (their formulas: the docstring of recipes/grpo.py)."""
    loss: PolicyLoss = "ppo"
    """Policy loss: ppo (token-level ratio), gspo (sequence-level ratio), cispo (REINFORCE with a clipped, detached ratio weight) or sapo (a soft, sigmoid gate in place of the clip)."""
    clip_low: float | None = None
    """Clip below: ratio >= 1 - clip_low (None: 0.2 for ppo, 3e-4 for gspo, no lower bound for cispo, as MiniMax-M1 and TRL; sapo has no clip)."""
    clip_high: float | None = None
    """Clip above: ratio <= 1 + clip_high (None: 0.2 for ppo, 4e-4 for gspo, 4.0 for cispo, i.e. TRL's recommended epsilon_high 5.0 as ratio <= 5; DAPO's clip-higher: 0.28; sapo has no clip)."""
    loss_agg: AggMode | None = None
    """How token losses add up over a mini-batch (None: token-mean for ppo and cispo, seq-mean-token-mean for gspo and sapo, as TRL's loss types)."""
    sapo_tau_pos: float = 1.0
    """sapo's gate temperature where the advantage is > 0 (TRL's and the SAPO paper's default 1.0)."""
    sapo_tau_neg: float = 1.05
    """sapo's gate temperature where the advantage is <= 0 (TRL's and the SAPO paper's default 1.05)."""
    kl_coef: float = 0.0
    """beta: weight of the KL to the reference policy (0: no reference model at all)."""
    kl_in_reward: bool | None = None
    """Put the KL in the reward (k1 per token) instead of the loss (None: in the reward for rloo, reinforce_pp, reinforce_pp_baseline; in the loss for grpo, drgrpo)."""
    kl_kind: KLKind = "low_var_kl"
    """KL estimator of the KL loss: k1, k2, k3, abs, low_var_kl (k3, clamped)."""
    gamma: float = 1.0
    """Discount of reinforce_pp's return-to-go (over the model's tokens only)."""


def resolve_critic_free(algo: CriticFreeConfig) -> CriticFreeConfig:
    """`algo` with the flags left unset filled in from its estimator and loss; flags its loss
    cannot take refused (ConfigError)."""
    if algo.loss == "sapo" and (algo.clip_low is not None or algo.clip_high is not None):
        raise ConfigError("--algo.loss sapo has no hard clip (its sigmoid gate is soft): leave --algo.clip-low and "
                          "--algo.clip-high unset; --algo.sapo-tau-pos / --algo.sapo-tau-neg set how fast it closes")
    if algo.sapo_tau_pos <= 0 or algo.sapo_tau_neg <= 0:
        raise ConfigError(f"--algo.sapo-tau-pos {algo.sapo_tau_pos} / --algo.sapo-tau-neg {algo.sapo_tau_neg}: "
                          "must be > 0 (sapo's gate temperatures)")
    clip_low, clip_high, loss_agg = LOSS_DEFAULTS[algo.loss]
    return dataclasses.replace(
        algo, clip_low=clip_low if algo.clip_low is None else algo.clip_low,
        clip_high=clip_high if algo.clip_high is None else algo.clip_high, loss_agg=algo.loss_agg or loss_agg,
        kl_in_reward=KL_IN_REWARD[algo.estimator] if algo.kl_in_reward is None else algo.kl_in_reward)


def critic_free_loss(log_probs, mb, entropy=None, *, algo: CriticFreeConfig, correction: algos.RolloutCorrection):
    """The clipped policy loss on the advantages, plus the KL loss to the reference, over the
    model's tokens (response_mask: a tool's output is 0), both aggregated as --algo.loss-agg
    (so that the update's micro-batch weighting is exact)."""
    mask = mb["response_mask"]
    # the engine sampled: its tokens weighted towards the trainer's policy where the two differ
    weights, corrected = correction(mb)
    # clipped below and above apart: a higher upper clip (DAPO) lets rare good tokens gain faster
    own = {arg: getattr(algo, field) for arg, field in LOSS_FLAGS.get(algo.loss, {}).items()}
    loss, metrics = algos.policy_loss_fn(algo.loss)(log_probs, mb["old_log_probs"], mb["advantages"], mask,
                                                    clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                                                    is_weights=weights, **own)
    metrics |= corrected
    if algo.kl_coef > 0 and not algo.kl_in_reward:   # in the loss, the KL leaves advantages group-relative
        kl = algos.aggregate_loss(algos.kl_penalty(log_probs, mb["ref_log_probs"], algo.kl_kind), mask, algo.loss_agg)
        loss = loss + algo.kl_coef * kl
        metrics["kl_loss"] = kl.item()
    return loss, metrics
