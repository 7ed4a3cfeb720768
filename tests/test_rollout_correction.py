"""Rollout correction (hflow.algos.correction): the engine's samples weighted towards the
trainer's policy. The oracle is the on-policy gradient of a tiny autoregressive policy, computed
exactly from its expected objective (∇ Σ_y π(y) A(y), no sampling and no score function)."""
import itertools
import math

import pytest
import torch

from hflow import algos

V, T = 3, 2   # a vocabulary of 3 tokens, responses of 2


class TinyPolicy:
    """π(y) = softmax(first)[y1] · softmax(second[y1])[y2]: a two-token autoregressive model."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def token_log_probs(self, ys: torch.Tensor) -> torch.Tensor:
        """[N, T] log π(y_t | y_<t) of the responses `ys` [N, T]."""
        first = torch.log_softmax(self.first, -1)[ys[:, 0]]
        second = torch.log_softmax(self.second, -1)[ys[:, 0], ys[:, 1]]
        return torch.stack([first, second], 1)


def policies(seed=0, perturbation=0.6):
    g = torch.Generator().manual_seed(seed)
    first, second = torch.randn(V, generator=g), torch.randn(V, V, generator=g)
    trainer = TinyPolicy(first.clone().requires_grad_(), second.clone().requires_grad_())
    # the engine: the same weights computed differently, here a deliberate perturbation
    engine = TinyPolicy(first + perturbation * torch.randn(V, generator=g),
                        second + perturbation * torch.randn(V, V, generator=g))
    return trainer, engine


def gradient(loss, policy):
    grads = torch.autograd.grad(loss, [policy.first, policy.second], allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in grads])


def on_policy_gradient(trainer, ys, advantage):
    """The oracle: ∇ E_π[A] = Σ_y A(y) ∇π(y), from the exact expectation."""
    return gradient((trainer.token_log_probs(ys).sum(-1).exp() * advantage).sum(), trainer)


def update_gradient(trainer, engine, ys, advantage, frequency, correction):
    """The gradient an update takes from the engine's samples `ys`, each counted `frequency`
    times (N·μ(y) for the exact expectation under μ, 1 for samples drawn from μ), with the
    policy loss at its on-policy point (old = current, detached) and `correction`'s weights."""
    logp = trainer.token_log_probs(ys)
    mask = torch.ones_like(logp)
    mb = {"old_log_probs": logp.detach(), "rollout_log_probs": engine.token_log_probs(ys),
          "response_mask": mask}
    weights, metrics = correction(mb)
    advantages = (advantage * frequency)[:, None].expand_as(logp)
    loss, _ = algos.policy_loss(logp, mb["old_log_probs"], advantages, mask, agg="seq-mean-token-sum",
                                is_weights=weights)
    return -gradient(loss, trainer), metrics


def all_responses():
    return torch.tensor(list(itertools.product(range(V), repeat=T)))


def test_sequence_level_is_gives_the_on_policy_gradient_from_the_engines_samples_exactly():
    trainer, engine = policies()
    ys = all_responses()
    advantage = torch.randn(len(ys), generator=torch.Generator().manual_seed(1))
    mu = engine.token_log_probs(ys).sum(-1).exp()
    expected = on_policy_gradient(trainer, ys, advantage)
    # the expectation under the engine's distribution: every response counted N·μ(y) times
    uncapped = algos.RolloutCorrection("tis", "sequence", cap=1e6)
    corrected, metrics = update_gradient(trainer, engine, ys, advantage, len(ys) * mu, uncapped)
    torch.testing.assert_close(corrected, expected, rtol=1e-5, atol=1e-6)
    uncorrected, _ = update_gradient(trainer, engine, ys, advantage, len(ys) * mu, algos.RolloutCorrection("none"))
    assert (uncorrected - expected).norm() > 0.2 * expected.norm()   # the engine's gradient, not the trainer's
    assert metrics["mismatch/capped_fraction"] == 0.0 and metrics["mismatch/abs_log_ratio_max"] > 0.1


def test_on_samples_drawn_from_the_engine_the_corrected_gradient_is_close_and_the_uncorrected_is_not():
    trainer, engine = policies(seed=2)
    ys_all = all_responses()
    advantage_of = torch.randn(len(ys_all), generator=torch.Generator().manual_seed(3))
    expected = on_policy_gradient(trainer, ys_all, advantage_of)
    mu = engine.token_log_probs(ys_all).sum(-1).exp()
    drawn = torch.multinomial(mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(4))
    ys, advantage = ys_all[drawn], advantage_of[drawn]
    corrected, _ = update_gradient(trainer, engine, ys, advantage, torch.ones(len(ys)),
                                   algos.RolloutCorrection("tis", "sequence", cap=1e6))
    uncorrected, _ = update_gradient(trainer, engine, ys, advantage, torch.ones(len(ys)),
                                     algos.RolloutCorrection("none"))
    assert (corrected - expected).norm() < 0.05 * expected.norm()
    assert (uncorrected - expected).norm() > 0.2 * expected.norm()


def test_token_level_is_is_exact_for_one_token_responses():
    trainer, engine = policies(seed=5)
    ys = torch.arange(V)[:, None]   # responses of one token: only the first position
    first = lambda policy, y: torch.log_softmax(policy.first, -1)[y[:, 0]][:, None]   # noqa: E731
    advantage = torch.tensor([1.0, -2.0, 0.5])
    expected = gradient((first(trainer, ys).exp()[:, 0] * advantage).sum(), trainer)
    logp = first(trainer, ys)
    mu = first(engine, ys).exp()[:, 0]
    mb = {"old_log_probs": logp.detach(), "rollout_log_probs": first(engine, ys), "response_mask": torch.ones(V, 1)}
    weights, _ = algos.RolloutCorrection("tis", "token", cap=1e6)(mb)
    loss, _ = algos.policy_loss(logp, logp.detach(), (advantage * V * mu)[:, None], mb["response_mask"],
                                agg="seq-mean-token-sum", is_weights=weights)
    torch.testing.assert_close(-gradient(loss, trainer), expected, rtol=1e-5, atol=1e-6)


def test_truncated_and_masked_weights_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.1, 0.4]]))
    engine = torch.log(torch.tensor([[0.25, 0.6, 0.9], [0.3, 0.1, float("nan")]]))   # ρ = 2, 0.5, ·; 3, 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])   # NaN and anything else outside the mask: ignored
    tis, m = algos.importance_weights(trainer, engine, mask, "tis", "token", cap=2.5)
    torch.testing.assert_close(tis, torch.tensor([[2.0, 0.5, 0.0], [2.5, 1.0, 0.0]]))
    assert m["capped_fraction"] == pytest.approx(0.25) and m["is_weight_mean"] == pytest.approx(6.0 / 4)
    mis, m = algos.importance_weights(trainer, engine, mask, "mis", "token", cap=2.5)
    torch.testing.assert_close(mis, torch.tensor([[2.0, 0.5, 0.0], [0.0, 1.0, 0.0]]))
    assert m["capped_fraction"] == pytest.approx(0.25) and m["is_weight_mean"] == pytest.approx(3.5 / 4)
    # sequence level: one ratio per response, the product of its tokens' (1.0 and 3.0)
    seq, m = algos.importance_weights(trainer, engine, mask, "tis", "sequence", cap=2.5)
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 0.0], [2.5, 2.5, 0.0]]))
    assert m["capped_fraction"] == pytest.approx(0.5) and m["is_weight_mean"] == pytest.approx(1.75)
    seq, _ = algos.importance_weights(trainer, engine, mask, "mis", "sequence", cap=2.5)
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_a_long_responses_sequence_ratio_does_not_overflow():
    trainer, engine = torch.zeros(1, 4000), torch.full((1, 4000), -0.1)   # ρ = e^400: inf in float32
    weights, m = algos.importance_weights(trainer, engine, torch.ones(1, 4000), "tis", "sequence", cap=3.0)
    assert torch.all(weights == 3.0) and m["capped_fraction"] == 1.0
    weights, _ = algos.importance_weights(trainer, engine, torch.ones(1, 4000), "mis", "sequence", cap=3.0)
    assert torch.all(weights == 0.0)


def test_mismatch_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, 7.0]])
    m = algos.mismatch_metrics(trainer, engine, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["abs_log_ratio_mean"] == pytest.approx(0.75) and m["abs_log_ratio_max"] == pytest.approx(1.0)
    k3 = [math.exp(d) - 1 - d for d in (0.5, -1.0)]   # KL(engine ‖ trainer) from the engine's samples
    assert m["kl_engine_trainer"] == pytest.approx(sum(k3) / 2)


def test_off_or_unmeasured_the_loss_is_unchanged():
    mb = {"old_log_probs": torch.tensor([[-1.0, -2.0]]), "rollout_log_probs": torch.tensor([[-1.2, -2.0]]),
          "response_mask": torch.ones(1, 2)}
    weights, metrics = algos.RolloutCorrection("none")(mb)
    assert weights is None and set(metrics) == {"mismatch/abs_log_ratio_mean", "mismatch/abs_log_ratio_max",
                                                "mismatch/kl_engine_trainer"}
    # the old log-probs are the engine's own: nothing to compare, nothing logged
    assert algos.RolloutCorrection("tis", measured=False)(mb) == (None, {})
    with pytest.raises(ValueError, match="unknown rollout correction"):
        algos.importance_weights(mb["old_log_probs"], mb["rollout_log_probs"], mb["response_mask"], "cispo")
