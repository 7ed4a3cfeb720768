"""CISPO and SAPO against their reference implementation: TRL's own code, run on the same tensors.

The oracle is TRL 1.16's `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py), the method
that computes `loss_type="cispo"` and `loss_type="sapo"` inline (the `if self.loss_type == "cispo"`
/ `elif self.loss_type == "sapo"` branches and the aggregation below them). It is called unbound
on a stand-in `self` whose `_get_per_token_logps_and_entropies` returns our log-probs as "the
model's": nothing of TRL's is copied, its lines run as they are. With one process, one
accumulation step and `num_items_in_batch` = the batch's token count, TRL's aggregations are
cispo: Σ L·m / Σ m (hflow's token-mean) and sapo: mean over sequences of their token means
(seq-mean-token-mean); those are the only ones each loss type has in TRL. The other two of
hflow's aggregations are checked on TRL's per-token losses (TRL's method run on one token at a
time) summed the way each aggregation says.

Convention mapped: TRL's CISPO caps the ratio at `epsilon_high` itself (r ≤ ε_max; recommended
5.0), hflow at 1 + clip_high (so clip_high 4.0 ↔ epsilon_high 5.0); neither has a lower bound.
"""
import functools
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hflow import algos
from hflow.recipe_kit.critic_free import CriticFreeConfig, critic_free_loss, resolve_critic_free
from hflow.validation import ConfigError

GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
GRPOConfig = pytest.importorskip("trl").GRPOConfig

TOL = 1e-6
# the largest difference each comparison measured, printed at the end (pytest -s) for the report
MEASURED = defaultdict(float)


def trl_loss(loss_type, logp, old, adv, mask, *, epsilon_high=0.2, tau_pos=1.0, tau_neg=1.05):
    """TRL's `GRPOTrainer._compute_loss` on these tensors: token-level ratios, no KL, no entropy
    mask, no vLLM correction, one process and accumulation step (training mode)."""
    B, T = logp.shape
    args = SimpleNamespace(sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg, delta=None,
                           use_bias_correction_kl=False, steps_per_generation=1)
    accelerator = SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                  gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, args=args, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        _metrics={"train": defaultdict(list)}, _entropy_bonus_enabled=False, aux_loss_enabled=False)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


def trl_token_losses(loss_type, logp, old, adv, mask, **kw):
    """TRL's per-token loss L_bt (0 where mask is 0): its method on each token alone, a 1×1 batch."""
    adv = torch.broadcast_to(adv[:, None] if adv.dim() == 1 else adv, logp.shape)
    rows = [[trl_loss(loss_type, logp[b:b + 1, t:t + 1], old[b:b + 1, t:t + 1], adv[b:b + 1, t:t + 1],
                      mask[b:b + 1, t:t + 1], **kw)[0] if mask[b, t] else logp[b, t] * 0
             for t in range(logp.shape[1])] for b in range(logp.shape[0])]
    return torch.stack([torch.stack(r) for r in rows])


def aggregated(L, mask, agg):
    """An aggregation of per-token losses L (0 off the mask), as its name says."""
    lens = mask.sum(-1)
    if agg == "token-mean":
        return L.sum() / mask.sum()
    if agg == "seq-mean-token-sum":
        return L.sum(-1).mean()
    return (L.sum(-1) / lens.clamp(min=1)).mean()


def case(shape, seed, dtype=torch.float64, seq_adv=False):
    """Log-probs, old log-probs (ratios e^±5, far outside every clip range, a few at e^±8), advantages
    of both signs (some exactly 0), a padded mask (right padding, a tool span, a 1-token row), and
    other log-probs at the padded positions (TRL multiplies by the mask, so there NaN, or a ratio whose
    exp overflows, would poison its gradient: 0·inf; hflow's own garbage test is below)."""
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    old = -torch.rand(shape, generator=g, dtype=dtype) * 4 - 0.05
    log_ratio = torch.randn(shape, generator=g, dtype=dtype) * 1.5
    log_ratio.view(-1)[::7] = 8.0
    log_ratio.view(-1)[3::11] = -8.0
    logp = old + log_ratio
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    lens[-1] = 1
    mask = (torch.arange(T)[None, :] < lens[:, None]).to(dtype)
    if T >= 4 and B >= 2:
        mask[0, 1:3] = 0                                  # tool output inside a multi-turn response
    adv = torch.randn(B if seq_adv else shape, generator=g, dtype=dtype) * 2
    adv.view(-1)[1::5] = 0.0
    garbage = -torch.rand(shape, generator=g, dtype=dtype) * 10   # a model's log-probs there: finite, <= 0
    logp = torch.where(mask.bool(), logp, garbage)
    return logp, old, adv, mask


def compare(name, ours, ref, tol=TOL):
    diff = (ours.detach() - ref.detach()).abs().max().item()
    MEASURED[name] = max(MEASURED[name], diff)
    assert diff <= tol, f"{name}: max |hflow - TRL| = {diff:.3g}"


SHAPES = [(1, 1), (3, 5), (8, 16), (16, 64)]
CASES = [(shape, seed, seq_adv) for seed, shape in enumerate(SHAPES) for seq_adv in (False, True)]
IDS = [f"{s[0]}x{s[1]}-{'seq' if a else 'token'}-adv" for s, _, a in CASES]


def hflow_and_trl(fn, trl_type, shape, seed, seq_adv, dtype, hflow_kw, trl_kw):
    logp, old, adv, mask = case(shape, seed, dtype, seq_adv)
    ours_lp = logp.clone().requires_grad_()
    ours, metrics = fn(ours_lp, old, adv[:, None].expand(shape) if seq_adv else adv, mask, **hflow_kw)
    (ours_grad,) = torch.autograd.grad(ours, ours_lp)
    ref_lp = logp.clone().requires_grad_()
    ref, ref_metrics = trl_loss(trl_type, ref_lp, old, adv, mask, **trl_kw)
    (ref_grad,) = torch.autograd.grad(ref, ref_lp)
    return (ours, ours_grad, metrics), (ref, ref_grad, ref_metrics), (logp, old, adv, mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,seed,seq_adv", CASES, ids=IDS)
@pytest.mark.parametrize("clip_high", [4.0, 0.28])
def test_cispo_equals_trl_loss_and_gradient(shape, seed, seq_adv, dtype, clip_high):
    (ours, g, metrics), (ref, ref_g, ref_metrics), (logp, old, adv, mask) = hflow_and_trl(
        algos.cispo_policy_loss, "cispo", shape, seed, seq_adv, dtype,
        {"clip_high": clip_high, "agg": "token-mean"}, {"epsilon_high": 1 + clip_high})
    compare(f"cispo loss {dtype}", ours, ref)   # 1e-6, absolute, in float32 too
    compare(f"cispo grad {dtype}", g, ref_g)
    assert (g[mask == 0] == 0).all() and ref.requires_grad
    # TRL's clip metric counts the capped tokens with A > 0; with no lower bound ours counts every capped one
    ratio = torch.exp(logp - old)
    capped = (ratio > 1 + clip_high) & mask.bool()
    assert ref_metrics["cispo_clip_ratio"][0] == pytest.approx(
        ((capped & (torch.broadcast_to(adv[:, None] if seq_adv else adv, shape) > 0)).sum() / mask.sum()).item())
    assert metrics["clipfrac"] == pytest.approx((capped.sum() / mask.sum()).item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,seed,seq_adv", CASES, ids=IDS)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_equals_trl_loss_and_gradient(shape, seed, seq_adv, dtype, taus):
    (ours, g, _), (ref, ref_g, _), (_, _, _, mask) = hflow_and_trl(
        algos.sapo_policy_loss, "sapo", shape, seed, seq_adv, dtype,
        {"tau_pos": taus[0], "tau_neg": taus[1], "agg": "seq-mean-token-mean"},
        {"tau_pos": taus[0], "tau_neg": taus[1]})
    compare(f"sapo loss {dtype}", ours, ref)   # 1e-6, absolute, in float32 too
    compare(f"sapo grad {dtype}", g, ref_g)
    assert (g[mask == 0] == 0).all() and ((g[mask == 1] != 0).any() or shape == (1, 1))   # 1x1: r = e^8, gate shut


@pytest.mark.parametrize("name,fn,trl_type,kw,trl_kw", [
    ("cispo", algos.cispo_policy_loss, "cispo", {}, {"epsilon_high": 5.0}),
    ("sapo", algos.sapo_policy_loss, "sapo", {}, {}),
])
@pytest.mark.parametrize("agg", algos.AGG_MODES)
def test_every_aggregation_of_trls_per_token_loss(name, fn, trl_type, kw, trl_kw, agg):
    logp, old, adv, mask = case((4, 6), 11)
    ours_lp = logp.clone().requires_grad_()
    ours, _ = fn(ours_lp, old, adv, mask, agg=agg, **kw)
    (g,) = torch.autograd.grad(ours, ours_lp)
    ref_lp = logp.clone().requires_grad_()
    ref = aggregated(trl_token_losses(trl_type, ref_lp, old, adv, mask, **trl_kw), mask, agg)
    (ref_g,) = torch.autograd.grad(ref, ref_lp)
    compare(f"{name} loss, each agg, float64", ours, ref)
    compare(f"{name} grad, each agg, float64", g, ref_g)


def test_defaults_are_trls():
    """hflow's defaults against a default TRL config: SAPO's temperatures are TRL's GRPOConfig
    defaults; CISPO's cap is TRL's documented recommendation (TRL leaves epsilon_high at epsilon,
    0.2, a cap of r ≤ 0.2, unless set: its help says 5.0 for cispo)."""
    trl_fields = GRPOConfig.__dataclass_fields__   # (an instance wants a bf16 GPU by default)
    algo = resolve_critic_free(CriticFreeConfig(loss="sapo"))
    assert (algo.sapo_tau_pos, algo.sapo_tau_neg) == (trl_fields["sapo_temperature_pos"].default,
                                                      trl_fields["sapo_temperature_neg"].default)
    assert (algo.clip_low, algo.clip_high, algo.loss_agg) == (None, None, "seq-mean-token-mean")
    algo = resolve_critic_free(CriticFreeConfig(loss="cispo"))
    assert (algo.clip_low, 1 + algo.clip_high, algo.loss_agg) == (None, 5.0, "token-mean")
    assert trl_fields["epsilon_high"].default is None and trl_fields["epsilon"].default == 0.2
    assert "the recommended value is `5.0`" in GRPOConfig.__doc__ and "5.0" in trl_fields["epsilon_high"].metadata["help"]


def test_losses_ignore_nan_and_inf_at_masked_out_positions():
    logp, old, adv, mask = case((4, 6), 5)
    for fn in (algos.cispo_policy_loss, algos.sapo_policy_loss):
        clean_lp = logp.clone().requires_grad_()
        clean, _ = fn(clean_lp, old, adv, mask)
        clean.backward()
        m = mask.bool()
        dirty_lp = torch.where(m, logp, float("inf")).requires_grad_()
        dirty, _ = fn(dirty_lp, torch.where(m, old, float("nan")), torch.where(m, adv, float("nan")), mask)
        dirty.backward()
        assert torch.equal(dirty, clean) and torch.equal(dirty_lp.grad, clean_lp.grad)


def test_sapo_refuses_a_hard_clip():
    with pytest.raises(ConfigError, match="sapo has no hard clip"):
        resolve_critic_free(CriticFreeConfig(loss="sapo", clip_high=0.28))
    with pytest.raises(ConfigError, match="must be > 0"):
        resolve_critic_free(CriticFreeConfig(loss="sapo", sapo_tau_neg=0.0))
    with pytest.raises(ValueError, match="no hard clip"):
        algos.sapo_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_high=0.2)


# ------------------------------------------------------------------ end to end through recipes/grpo.py's flags

@pytest.fixture(scope="module")
def grpo_recipe():
    path = Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_recipe_peer", path)
    module = sys.modules["grpo_recipe_peer"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [["--algo.loss", "cispo"], ["--algo.loss", "sapo"],
                                   ["--algo.loss", "cispo", "--algo.clip-low", "0.5", "--algo.clip-high", "1.0"],
                                   ["--algo.loss", "sapo", "--algo.sapo-tau-pos", "2", "--algo.sapo-tau-neg", "3",
                                    "--algo.kl-coef", "0.01"]], ids=lambda f: " ".join(f))
def test_algo_loss_flag_runs_an_update_through_critic_free_loss(grpo_recipe, flags):
    """`--algo.loss cispo|sapo` parsed by the recipe's own config, resolved by its resolve_algo,
    then one update of a tiny policy through critic_free_loss, as the actor's micro-batch loss:
    the loss equals the registered function's, the gradient reaches every parameter, and the
    responses with A > 0 gain log-probability while those with A < 0 lose it."""
    import tyro
    cfg = tyro.cli(grpo_recipe.Config, args=flags)
    algo = grpo_recipe.resolve_algo(cfg.algo, cfg.rollout.max_tokens)
    assert algo.loss == flags[1]
    torch.manual_seed(0)
    B, T, V = 8, 5, 11                               # 2 prompts x 4 samples
    policy = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Tanh(), torch.nn.Linear(16, V))
    tokens = torch.randint(V, (B, T + 1))
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[5, 1:] = 0

    def log_probs():
        return torch.log_softmax(policy(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]

    with torch.no_grad():
        old = log_probs()
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    advantages = algos.estimator(algo.estimator)(algos.scores_to_token_rewards(scores, mask), mask,
                                                 torch.arange(B) // 4, gamma=algo.gamma)
    mb = {"response_mask": mask, "old_log_probs": old, "advantages": advantages,
          "ref_log_probs": old - 0.1, "rollout_log_probs": old}
    loss_fn = functools.partial(critic_free_loss, algo=algo, correction=algos.RolloutCorrection(measured=False))
    optim = torch.optim.SGD(policy.parameters(), lr=0.5)
    for _ in range(3):   # the first pass on-policy (r = 1), then off-policy
        lp = log_probs()
        loss, metrics = loss_fn(lp, mb)
        want, _ = algos.policy_loss_fn(algo.loss)(lp, old, advantages, mask, clip_low=algo.clip_low,
                                                  clip_high=algo.clip_high, agg=algo.loss_agg,
                                                  **({"tau_pos": algo.sapo_tau_pos, "tau_neg": algo.sapo_tau_neg}
                                                     if algo.loss == "sapo" else {}))
        if algo.kl_coef:
            want = want + algo.kl_coef * algos.aggregate_loss(algos.kl_penalty(lp, mb["ref_log_probs"], algo.kl_kind),
                                                             mask, algo.loss_agg)
            assert "kl_loss" in metrics
        assert torch.isfinite(loss) and torch.equal(loss, want) and "approx_kl" in metrics
        optim.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
        optim.step()
    with torch.no_grad():
        gain = ((log_probs() - old) * mask).sum(-1)
    assert (gain[scores == 1] > 0).all() and (gain[scores == 0] < 0).all(), gain


def test_registry_holds_the_four_losses():
    assert list(algos.POLICY_LOSSES) == ["ppo", "gspo", "cispo", "sapo"]
    assert algos.policy_loss_fn("cispo") is algos.cispo_policy_loss
    assert algos.policy_loss_fn("sapo") is algos.sapo_policy_loss


def test_zz_print_measured_differences():
    """(last in the file) the largest |hflow − TRL| of each comparison above, for the record."""
    for name, diff in sorted(MEASURED.items()):
        print(f"max |hflow - TRL| {name}: {diff:.3g}")
