"""hflow.algos against hand-computed values and independent plain-Python loops.

The oracles here never call the vectorised code under test: they walk lists of floats with the
textbook formula (or use torch.distributions / statistics), so a shared bug cannot hide.
"""
import math
import statistics

import pytest
import torch

from hflow import algos

NAN = float("nan")


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol)


def rand_batch(B=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1                                      # every response has a token
    mask[0] = 0
    mask[0, [0, 1, 4]] = 1                              # multi-turn: tool output at 2, 3
    mask[1, :] = 1
    return g, mask


# --------------------------------------------------------------------------------- reductions

def test_masked_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert close(algos.masked_mean(x, m), (1 + 2 + 4 + 6) / 4)
    assert close(algos.masked_mean(x, m, dim=-1), [1.5, 5.0])
    assert close(algos.masked_mean(x, m, dim=0), [2.5, 2.0, 6.0])
    assert algos.masked_mean(x, torch.zeros_like(m)).item() == 0.0  # empty mask: 0, not NaN


def test_masked_whiten_against_statistics():
    g, m = rand_batch()
    x = torch.randn(m.shape, generator=g)
    x[m == 0] = NAN
    vals = [x[i, j].item() for i in range(m.shape[0]) for j in range(m.shape[1]) if m[i, j]]
    mu, var = statistics.mean(vals), statistics.variance(vals)  # variance: unbiased
    out = algos.masked_whiten(x, m)
    kept = algos.masked_whiten(x, m, shift_mean=False)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            if m[i, j]:
                assert close(out[i, j], (x[i, j].item() - mu) / math.sqrt(var + 1e-8))
                assert close(kept[i, j], (x[i, j].item() - mu) / math.sqrt(var + 1e-8) + mu)
            else:
                assert out[i, j] == 0 and kept[i, j] == 0


def test_aggregate_loss_each_mode_by_hand():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert close(algos.aggregate_loss(L, m, "token-mean"), (1 + 2 + 4) / 3)
    assert close(algos.aggregate_loss(L, m, "seq-mean-token-sum"), (3 + 4) / 2)
    assert close(algos.aggregate_loss(L, m, "seq-mean-token-mean"), (1.5 + 4) / 2)
    # an empty row counts in B and contributes 0
    m0 = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert close(algos.aggregate_loss(L, m0, "seq-mean-token-mean"), 1.5 / 2)
    with pytest.raises(ValueError, match="token-mean"):
        algos.aggregate_loss(L, m, "sum")


def test_scores_to_token_rewards():
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    r = algos.scores_to_token_rewards([2.0, -1.0, 5.0], m)
    assert torch.equal(r, torch.tensor([[0, 2.0, 0, 0], [0, 0, -1.0, 0], [0, 0, 0, 0]]))


# --------------------------------------------------------------------------------- GAE

def gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE on the masked-in tokens of each row, compressed into a plain list."""
    B, T = len(mask), len(mask[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        r = [rewards[b][t] for t in idx]
        v = [values[b][t] for t in idx] + [0.0]
        a = [0.0] * (len(idx) + 1)
        for k in reversed(range(len(idx))):
            a[k] = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * a[k + 1]
        for k, t in enumerate(idx):
            adv[b][t] = a[k]
    return adv


def test_gae_by_hand():
    # gamma = lam = 1: A_t = (sum of rewards from t) − V_t;  mask 0 at t=1 skips that token
    r = torch.tensor([[0.0, 9.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.6, 0.7]])
    m = torch.tensor([[1, 0, 1, 1]])
    adv, ret = algos.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert close(adv, [[0.5, 0.0, 0.4, 0.3]])
    assert close(ret, [[1.0, 0.0, 1.0, 1.0]])
    # gamma = 0.5, lam = 0.5 on two tokens: δ1 = 1 − 0.7 = 0.3, δ0 = 0 + 0.5·0.7 − 0.5 = −0.15,
    # A0 = −0.15 + 0.25·0.3 = −0.075
    adv, ret = algos.gae_advantages(r[:, 2:], v[:, 2:] - torch.tensor([[0.1, 0.0]]), m[:, 2:], 0.5, 0.5)
    assert close(adv, [[-0.075, 0.3]]) and close(ret, [[0.425, 1.0]])


def test_gae_against_loop_and_multi_turn_property():
    g, m = rand_batch(B=5, T=9, seed=1)
    r = torch.randn(m.shape, generator=g)
    v = torch.randn(m.shape, generator=g)
    adv, ret = algos.gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    oracle = gae_loop(r.tolist(), v.tolist(), m.tolist(), 0.9, 0.8)
    assert close(adv, oracle)
    assert close(ret, torch.where(m.bool(), torch.tensor(oracle) + v, 0))
    # rewards and values at masked-out positions (tool output, padding) change nothing,
    # not even when they are NaN
    r2, v2 = r.clone(), v.clone()
    r2[m == 0], v2[m == 0] = NAN, NAN
    adv2, ret2 = algos.gae_advantages(r2, v2, m, gamma=0.9, lam=0.8)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()
    # the multi-turn row equals GAE on the same row with the tool tokens cut out
    keep = m[0].bool()
    adv_cut, _ = algos.gae_advantages(r[:1, keep], v[:1, keep], m[:1, keep], 0.9, 0.8)
    assert close(adv[0, keep], adv_cut[0])


def test_gae_is_detached():
    m = torch.ones(2, 3)
    v = torch.randn(2, 3, requires_grad=True)
    adv, ret = algos.gae_advantages(torch.randn(2, 3), v, m, 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------------- group baselines

def test_grpo_by_hand():
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    scores = [1.0, 0.0, 0.0, 1.0, 3.0]
    ids = torch.tensor([7, 7, 7, 7, 2])
    adv = algos.grpo_advantages(scores, ids, m)
    # group 7: mean 0.5, unbiased std sqrt(4·0.25/3) = 0.57735; group 2 has one sample -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert close(adv, [[a, a, 0], [-a, 0, 0], [-a, -a, -a], [a, a, a], [0, 0, 0]])
    dr = algos.grpo_advantages(scores, ids, m, norm_by_std=False)  # Dr.GRPO
    assert close(dr[:, 0], [0.5, -0.5, -0.5, 0.5, 0.0])
    # a group where every sample scored the same gets 0, not a division by zero
    same = algos.grpo_advantages([1.0, 1.0], [0, 0], torch.ones(2, 2))
    assert (same == 0).all()


def test_grpo_against_statistics_with_string_ids():
    g = torch.Generator().manual_seed(3)
    ids = ["p0", "p1", "p0", "p2", "p1", "p0", "p1", "p1"]
    scores = torch.randn(len(ids), generator=g)
    m = (torch.rand(len(ids), 5, generator=g) > 0.2).float()
    adv = algos.grpo_advantages(scores, ids, m, eps=1e-6)
    for i, gid in enumerate(ids):
        grp = [scores[j].item() for j in range(len(ids)) if ids[j] == gid]
        want = 0.0 if len(grp) == 1 else \
            (scores[i].item() - statistics.mean(grp)) / (statistics.stdev(grp) + 1e-6)
        assert close(adv[i], m[i] * want)


def test_rloo_against_leave_one_out_loop():
    g = torch.Generator().manual_seed(4)
    ids = [0, 0, 0, 1, 1, 2, 1, 0]
    scores = torch.randn(len(ids), generator=g)
    m = torch.ones(len(ids), 3)
    m[2, 1:] = 0
    adv = algos.rloo_advantages(scores, torch.tensor(ids), m)
    for i, gid in enumerate(ids):
        others = [scores[j].item() for j in range(len(ids)) if ids[j] == gid and j != i]
        want = 0.0 if not others else scores[i].item() - sum(others) / len(others)
        assert close(adv[i], m[i] * want)
    # by hand: scores 1, 2, 6 -> 1 − 4, 2 − 3.5, 6 − 1.5
    assert close(algos.rloo_advantages([1.0, 2.0, 6.0], [5, 5, 5], torch.ones(3, 1))[:, 0],
                 [-3.0, -1.5, 4.5])


def test_remax_by_hand():
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = algos.remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.5]), m)
    assert close(adv, [[0.75, 0.75, 0], [-0.5, 0, 0]])


def test_reinforce_pp_against_loop():
    g, m = rand_batch(B=4, T=6, seed=5)
    r = torch.randn(m.shape, generator=g)
    r[m == 0] = NAN  # ignored
    gamma = 0.9
    rtg = [[0.0] * 6 for _ in range(4)]
    for b in range(4):
        running = 0.0
        for t in reversed(range(6)):
            if m[b, t]:
                running = r[b, t].item() + gamma * running
                rtg[b][t] = running
    vals = [rtg[b][t] for b in range(4) for t in range(6) if m[b, t]]
    mu, sd = statistics.mean(vals), math.sqrt(statistics.variance(vals) + 1e-8)
    want = [[(rtg[b][t] - mu) / sd if m[b, t] else 0.0 for t in range(6)] for b in range(4)]
    assert close(algos.reinforce_pp_advantages(r, m, gamma), want)


def test_rloo_is_k_over_k_minus_1_times_the_centred_score_by_hand():
    # k = 2: each sample's baseline is the other one: A = s_i − s_j = 2/1·(s_i − mean)
    adv = algos.rloo_advantages([4.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]]))
    assert close(adv, [[4.0, 4.0], [-4.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # k = 4, scores 1, 0, 0, 0: mean 1/4, A_1 = 4/3·3/4 = 1 (= 1 − 0), A_others = 4/3·(−1/4) = −1/3
    adv = algos.rloo_advantages([1.0, 0.0, 0.0, 0.0], [0] * 4, torch.ones(4, 1))
    assert close(adv[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_reinforce_pp_with_kl_in_the_reward_by_hand():
    # scores 1, 0 on the last tokens, k1 KL [[1, 1], [2, ·]], β = 0.1:
    # r = [[−0.1, 0.9], [−0.2, ·]]
    mask = torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[1.0, 1.0], [2.0, NAN]])
    r = algos.scores_to_token_rewards([1.0, 0.0], mask) - 0.1 * torch.where(mask.bool(), kl, 0)
    # γ = 1: returns 0.8, 0.9, −0.2; batch mean 0.5, unbiased variance (0.09 + 0.16 + 0.49)/2 = 0.37
    sd = math.sqrt(0.37 + 1e-8)
    assert close(algos.reinforce_pp_advantages(r, mask, gamma=1.0), [[0.3 / sd, 0.4 / sd], [-0.7 / sd, 0.0]])
    # γ = 0.5: returns −0.1 + 0.5·0.9 = 0.35, 0.9, −0.2; mean 0.35, variance (0 + 0.3025·2)/2: std 0.55
    assert close(algos.reinforce_pp_advantages(r, mask, gamma=0.5), [[0.0, 1.0], [-1.0, 0.0]])


def test_reinforce_pp_baseline_by_hand():
    # group means subtracted (no /std of the group): 2, 0 -> 1, −1; 4, 0 -> 2, −2; then whitened over
    # the batch's 4 tokens: mean 0, unbiased variance (1 + 1 + 4 + 4)/3 = 10/3
    sd = math.sqrt(10 / 3 + 1e-8)
    adv = algos.reinforce_pp_baseline_advantages([2.0, 0.0, 4.0, 0.0], ["a", "a", "b", "b"], torch.ones(4, 1))
    assert close(adv[:, 0], [1 / sd, -1 / sd, 2 / sd, -2 / sd])
    # (GRPO would give both groups ±0.7071: it divides each group by its own std)
    # tokens, not sequences, are whitened: 3, 1 -> ±1 on one token each; 2, 2 -> 0 on two tokens
    # each: 6 tokens, mean 0, variance (1 + 1)/5 = 0.4
    mask = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 1]])
    adv = algos.reinforce_pp_baseline_advantages([3.0, 1.0, 2.0, 2.0], [0, 0, 1, 1], mask)
    a = 1 / math.sqrt(0.4 + 1e-8)
    assert close(adv, [[a, 0.0], [-a, 0.0], [0.0, 0.0], [0.0, 0.0]])


def test_dynamic_sampling_keeps_only_groups_whose_scores_differ():
    # groups: 0 all right, 1 mixed, 2 all wrong, 3 a single sample, 4 mixed in a non-binary score
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.3]
    ids = [0, 0, 1, 1, 2, 2, 3, 4, 4, 4]
    keep = algos.groups_with_varied_scores(scores, ids)
    assert keep.tolist() == [False, False, True, True, False, False, False, True, True, True]
    assert keep.dtype == torch.bool


def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then −factor·(|y| − 6)/4, −factor at 10
    assert close(algos.overlong_penalty([3, 6, 7, 8, 10], max_tokens=10, buffer=4),
                 [0.0, 0.0, -0.25, -0.5, -1.0])
    assert close(algos.overlong_penalty(torch.tensor([7, 10]), 10, 4, factor=0.5), [-0.125, -0.5])
    with pytest.raises(ValueError, match="overlong buffer"):
        algos.overlong_penalty([3], max_tokens=10, buffer=11)


def test_group_id_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="group id"):
        algos.grpo_advantages([1.0, 2.0], [0], torch.ones(2, 2))
    with pytest.raises(ValueError, match="one score per row"):
        algos.rloo_advantages([1.0], [0, 0], torch.ones(2, 2))


# --------------------------------------------------------------------------------- KL

def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    assert close(algos.kl_penalty(logp, ref, "k1"), d)
    assert close(algos.kl_penalty(logp, ref, "k2"), [0.125, 0.5, 0.0])
    k3 = [math.exp(-x) + x - 1 for x in d]
    assert close(algos.kl_penalty(logp, ref, "k3"), k3)
    assert close(algos.kl_penalty(logp, ref, "low_var_kl"), k3)
    assert close(algos.kl_penalty(logp, ref, "abs"), [0.5, 1.0, 0.0])
    # low_var_kl clamps what k3 does not
    far = algos.kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert far.item() == 10.0
    with pytest.raises(ValueError, match="k3"):
        algos.kl_penalty(logp, ref, "k4")


def test_k3_is_unbiased_estimate_of_kl():
    # samples from π; E[k3] = KL(π ‖ π_ref) for two known categoricals
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = algos.kl_penalty(p.log()[x], q.log()[x], "k3").mean().item()
    assert abs(est - kl) < 0.01


# --------------------------------------------------------------------------------- policy loss

def ppo_token_loss(lp, old, a, cl, ch, c):
    """One token's PPO loss by case analysis, the way the papers state it."""
    r = math.exp(lp - old)
    if a >= 0:
        loss = -a * min(r, 1 + ch)          # gain capped above 1 + clip_high
    else:
        loss = -a * max(r, 1 - cl)          # cost floored below 1 − clip_low
        if c is not None:
            loss = min(loss, -a * c)        # dual-clip: at most |A|·c
    return loss


def agg_loop(L, m, agg):
    rows = [[L[b][t] for t in range(len(m[b])) if m[b][t]] for b in range(len(m))]
    if agg == "token-mean":
        flat = [x for row in rows for x in row]
        return sum(flat) / len(flat)
    if agg == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    return sum(sum(row) / len(row) for row in rows) / len(rows)


@pytest.mark.parametrize("agg", algos.AGG_MODES)
@pytest.mark.parametrize("cl,ch,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_policy_loss_against_case_analysis(agg, cl, ch, c):
    g, m = rand_batch(B=4, T=8, seed=6)
    old = -torch.rand(m.shape, generator=g) * 3
    logp = old + torch.randn(m.shape, generator=g) * 0.8  # ratios from ~0.1 to ~10
    a = torch.randn(m.shape, generator=g) * 2
    loss, metrics = algos.policy_loss(logp, old, a, m, clip_low=cl, clip_high=ch, dual_clip=c,
                                      agg=agg)
    L = [[ppo_token_loss(logp[b, t].item(), old[b, t].item(), a[b, t].item(), cl, ch, c)
          for t in range(8)] for b in range(4)]
    assert close(loss, agg_loop(L, m.tolist(), agg))
    assert set(metrics) == ({"clipfrac", "approx_kl"} | ({"clipfrac_lower"} if c else set()))
    assert all(type(v) is float for v in metrics.values())


def test_policy_loss_hits_each_branch_with_exact_gradients():
    # one token per case; token-mean over 6 tokens, so an unclipped token's gradient is −A·r/6
    r = torch.tensor([1.1, 1.5, 0.5, 0.9, 0.5, 2.0, 5.0])
    a = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    m = torch.tensor([1, 1, 1, 1, 1, 1, 0])  # the last token is padding
    old = torch.full((7,), -1.0, requires_grad=True)
    logp = (old.detach() + r.log()).requires_grad_()
    adv = a.clone().requires_grad_()
    loss, metrics = algos.policy_loss(logp[None], old[None], adv[None], m[None],
                                      clip_low=0.2, clip_high=0.28, dual_clip=1.8)
    # per token: A>0 inside | A>0 r>1+ch: clipped | A>0 r<1−cl: unclipped | A<0 inside |
    #            A<0 r<1−cl: clipped | A<0 r>c: dual-clipped (cap 1.8)
    want = [-1.1, -1.28, -0.5, 0.9, 0.8, 1.8]
    assert close(loss, sum(want) / 6)
    loss.backward()
    grad_want = [-1.1 / 6, 0, -0.5 / 6, 0.9 / 6, 0, 0, 0]
    assert close(logp.grad, grad_want)
    assert old.grad is None and adv.grad is None  # no gradient into old_logp or advantages
    assert close(metrics["clipfrac"], 2 / 6)
    assert close(metrics["clipfrac_lower"], 1 / 6)
    k3 = [ri - 1 - math.log(ri) for ri in r[:6].tolist()]
    assert close(metrics["approx_kl"], sum(k3) / 6)


def test_clip_higher_keeps_gradient_that_symmetric_clip_drops():
    logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    old, a, m = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    loss, met = algos.policy_loss(logp, old, a, m, clip_high=0.2)
    assert met["clipfrac"] == 1.0 and close(loss, -1.2)
    (g_sym,) = torch.autograd.grad(loss, logp)
    loss, met = algos.policy_loss(logp, old, a, m, clip_high=0.28)
    assert met["clipfrac"] == 0.0 and close(loss, -1.25)
    (g_high,) = torch.autograd.grad(loss, logp)
    assert g_sym.item() == 0.0 and close(g_high, [[-1.25]])


def test_losses_ignore_garbage_at_masked_out_positions():
    g, m = rand_batch(B=3, T=5, seed=7)
    logp = -torch.rand(m.shape, generator=g)
    old = logp + 0.1 * torch.randn(m.shape, generator=g)
    a = torch.randn(m.shape, generator=g)
    for fn in (algos.policy_loss, algos.gspo_policy_loss):
        clean_lp = logp.clone().requires_grad_()
        clean, _ = fn(clean_lp, old, a, m)
        clean.backward()
        dirty_lp = torch.where(m.bool(), logp, float("inf")).requires_grad_()
        dirty, _ = fn(dirty_lp, torch.where(m.bool(), old, NAN), torch.where(m.bool(), a, NAN), m)
        dirty.backward()
        assert close(dirty, clean) and torch.equal(dirty_lp.grad, clean_lp.grad)
        assert (clean_lp.grad[m == 0] == 0).all() and (clean_lp.grad[m == 1] != 0).any()


# --------------------------------------------------------------------------------- GSPO

def gspo_reference(logp, old, a, m, cl, ch):
    """GSPO written the sequence-level way: one ratio and one loss per sequence, mean over B."""
    lens = m.sum(-1)
    s = torch.exp(((logp - old) * m).sum(-1) / lens)
    A = (a * m).sum(-1) / lens                              # the sequence's advantage
    return torch.maximum(-A * s, -A * s.clamp(1 - cl, 1 + ch)).mean()


def test_gspo_equals_sequence_level_objective_and_its_gradient():
    g, m = rand_batch(B=6, T=5, seed=8)
    old = -torch.rand(m.shape, generator=g) * 2
    logp = (old + 0.3 * torch.randn(m.shape, generator=g)).requires_grad_()
    a = torch.randn(6, 1, generator=g).expand(6, 5)  # sequence-level advantages broadcast
    for cl, ch in [(3e-4, 4e-4), (0.1, 0.1)]:  # both clip some sequences, not all
        loss, met = algos.gspo_policy_loss(logp, old, a, m, clip_low=cl, clip_high=ch)
        ref = gspo_reference(logp, old, a, m, cl, ch)
        assert close(loss, ref)
        (g_ours,) = torch.autograd.grad(loss, logp)
        (g_ref,) = torch.autograd.grad(ref, logp)
        assert close(g_ours, g_ref)
        # clipfrac counts tokens of the sequences whose clipped term wins
        s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1)).detach()
        A = a[:, 0]
        seq_clipped = ((A > 0) & (s > 1 + ch)) | ((A < 0) & (s < 1 - cl))
        assert close(met["clipfrac"], (m * seq_clipped[:, None]).sum() / m.sum())
        assert 0 < met["clipfrac"] < 1


def test_gspo_default_clip_is_the_papers():
    # s = exp(5e-4) > 1 + 4e-4 with A > 0: clipped by the default, not by a wider one
    logp = torch.full((1, 3), 5e-4, requires_grad=True)
    old, a, m = torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)
    loss, met = algos.gspo_policy_loss(logp, old, a, m)
    assert met["clipfrac"] == 1.0 and close(loss, -(1 + 4e-4))
    assert torch.autograd.grad(loss, logp)[0].abs().max() == 0


# --------------------------------------------------------------------------------- value loss

@pytest.mark.parametrize("agg", algos.AGG_MODES)
@pytest.mark.parametrize("clip", [0.5, 0.1, None])
def test_value_loss_against_loop(agg, clip):
    g, m = rand_batch(B=3, T=6, seed=9)
    old = torch.randn(m.shape, generator=g)
    ret = torch.randn(m.shape, generator=g)
    values = (old + torch.randn(m.shape, generator=g)).requires_grad_()
    loss, met = algos.value_loss(values, old, ret, m, clip=clip, agg=agg)
    L, n_clipped = [], 0
    for b in range(3):
        row = []
        for t in range(6):
            v, o, R = values[b, t].item(), old[b, t].item(), ret[b, t].item()
            plain = (v - R) ** 2
            if clip is None:
                row.append(0.5 * plain)
                continue
            vc = min(max(v, o - clip), o + clip)
            row.append(0.5 * max(plain, (vc - R) ** 2))
            n_clipped += bool(m[b, t]) and (vc - R) ** 2 > plain
        L.append(row)
    assert close(loss, agg_loop(L, m.tolist(), agg))
    assert close(met["clipfrac"], n_clipped / m.sum().item())
    loss.backward()
    assert (values.grad[m == 0] == 0).all()


def test_value_loss_ignores_garbage_at_masked_out_positions():
    g, m = rand_batch(B=3, T=5, seed=11)
    old, ret = torch.randn(m.shape, generator=g), torch.randn(m.shape, generator=g)
    v = old + torch.randn(m.shape, generator=g)
    clean_v = v.clone().requires_grad_()
    clean, _ = algos.value_loss(clean_v, old, ret, m, clip=0.2)
    clean.backward()
    bad = lambda x: torch.where(m.bool(), x, NAN)
    dirty_v = bad(v).requires_grad_()
    dirty, _ = algos.value_loss(dirty_v, bad(old), bad(ret), m, clip=0.2)
    dirty.backward()
    assert close(dirty, clean) and torch.equal(dirty_v.grad, clean_v.grad)


def test_value_loss_gradient_by_hand():
    # token 0 inside the clip: grad (v − R)/2; token 1 clipped and the clipped term wins: grad 0
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    old, ret, m = torch.tensor([[0.8, 0.0]]), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2)
    loss, met = algos.value_loss(values, old, ret, m, clip=0.5)
    assert close(loss, 0.5 * (1.0 + 2.5 ** 2) / 2) and met["clipfrac"] == 0.5
    loss.backward()
    assert close(values.grad, [[0.5, 0.0]])


# --------------------------------------------------------------------------------- entropy

def test_entropy_against_categorical_and_by_hand():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(10), requires_grad=True)
    ours = algos.entropy_from_logits(logits)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert ours.shape == (2, 3) and close(ours, ref)
    g1 = torch.autograd.grad(ours.sum(), logits)[0]
    g2 = torch.autograd.grad(ref.sum(), logits)[0]
    assert close(g1, g2)
    assert close(algos.entropy_from_logits(torch.zeros(4)), math.log(4))
    p = [0.5, 0.25, 0.25]
    assert close(algos.entropy_from_logits(torch.tensor(p).log()), -sum(x * math.log(x) for x in p))


# --------------------------------------------------------------------------------- KL controllers

def test_fixed_kl_controller():
    c = algos.FixedKLController(0.05)
    c.update(100.0, 512)
    assert c.value == 0.05
    d = algos.FixedKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.05


def test_adaptive_kl_controller_by_hand():
    c = algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    c.update(9.0, 256)                    # err = clip(0.5) = 0.2  -> × (1 + 0.2·256/1e4)
    assert close(c.value, 0.1 * 1.00512, tol=1e-12)
    c.update(torch.tensor(3.0), 256)      # err = clip(−0.5) = −0.2 -> × 0.99488
    assert close(c.value, 0.1 * 1.00512 * 0.99488, tol=1e-12)
    c.update(6.6, 100)                    # err = 0.1 (inside the clip) -> × 1.001
    want = 0.1 * 1.00512 * 0.99488 * 1.001
    assert close(c.value, want, tol=1e-12)
    c.update(6.0, 1000)                   # on target: unchanged
    assert close(c.value, want, tol=1e-12)
    state = c.state_dict()
    resumed = algos.AdaptiveKLController(0.1, 6.0, 10000)
    resumed.load_state_dict(state)
    assert resumed.value == c.value and isinstance(state["value"], float)
    with pytest.raises(ValueError):
        algos.AdaptiveKLController(0.1, 0.0, 10000)


# --------------------------------------------------------------------------------- critic diagnostics

def test_explained_variance_by_hand():
    # masked-in returns 1, 0, 1, 0 (mean ½, variance ¼); padding holds garbage
    returns = torch.tensor([[1.0, 1.0, NAN], [0.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    perfect = returns.clone()
    assert algos.explained_variance(perfect, returns, mask) == pytest.approx(1.0)
    assert algos.explained_variance(perfect + 3.0, returns, mask) == pytest.approx(1.0)   # an offset costs nothing
    assert algos.explained_variance(torch.full_like(returns, 0.5), returns, mask) == pytest.approx(0.0)
    # V = 0.75, 0.75, 0.25, 0.25: errors ±¼, variance 1/16 -> EV = 1 − (1/16)/(1/4) = ¾
    half_way = torch.tensor([[0.75, 0.75, NAN], [0.25, 0.25, -5.0]])
    assert algos.explained_variance(half_way, returns, mask) == pytest.approx(0.75)
    # the wrong way round: V = 0, 0, 1, 1: errors 1, 1, −1, −1, variance 1 -> EV = 1 − 1/¼ = −3
    backwards = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert algos.explained_variance(backwards, returns, mask) == pytest.approx(-3.0)
    # returns that do not vary: 1 when the error does not either, else 0 (no division by 0)
    flat = torch.ones(2, 3)
    assert algos.explained_variance(torch.zeros(2, 3), flat, mask) == 1.0
    assert algos.explained_variance(half_way.nan_to_num(), flat, mask) == 0.0
    assert isinstance(algos.explained_variance(half_way, returns, mask), float)


# ---------------------------------------------------------------------------------------------
# the registries recipes pick an estimator and a policy loss from


def test_registered_estimators_are_the_papers_formulas_on_the_summed_token_rewards():
    g, mask = rand_batch(B=6, T=5, seed=3)
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    token_rewards = algos.scores_to_token_rewards(scores, mask) - 0.1 * torch.rand(6, 5, generator=g) * mask
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    summed = token_rewards.sum(-1)
    expected = {
        "grpo": algos.grpo_advantages(summed, groups, mask),
        "drgrpo": algos.grpo_advantages(summed, groups, mask, norm_by_std=False),
        "rloo": algos.rloo_advantages(summed, groups, mask),
        "reinforce_pp": algos.reinforce_pp_advantages(token_rewards, mask, 0.9),
        "reinforce_pp_baseline": algos.reinforce_pp_baseline_advantages(summed, groups, mask),
    }
    assert list(algos.ESTIMATORS) == list(expected)   # recipes/grpo.py's --algo.estimator choices, in order
    for name, advantages in expected.items():
        assert torch.equal(algos.estimator(name)(token_rewards, mask, groups, gamma=0.9), advantages), name
    # Dr.GRPO by hand on group 1: s - mean_g
    group1 = summed[3:]
    assert close(algos.estimator("drgrpo")(token_rewards, mask, groups)[3:, 0], group1 - group1.mean())


def test_registries_refuse_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered: grpo, drgrpo"):
        algos.estimator("ppo")
    with pytest.raises(ValueError, match="registered already"):
        algos.register_estimator("grpo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="unknown policy loss 'dpo'; registered: ppo, gspo"):
        algos.policy_loss_fn("dpo")
    with pytest.raises(ValueError, match="registered already"):
        algos.register_policy_loss("ppo")(lambda *a, **k: None)


def test_a_registered_estimator_is_found_by_name():
    @algos.register_estimator("test_constant")
    def constant(token_rewards, mask, groups, *, gamma=1.0):
        return mask * 2.0
    try:
        mask = torch.ones(2, 3)
        assert torch.equal(algos.estimator("test_constant")(mask, mask, torch.arange(2)), 2 * mask)
    finally:
        del algos.ESTIMATORS["test_constant"]


def test_policy_loss_registry_holds_the_two_losses():
    assert algos.policy_loss_fn("ppo") is algos.policy_loss and algos.policy_loss_fn("gspo") is algos.gspo_policy_loss


def test_nll_loss_is_the_token_mean_of_minus_log_p():
    log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = algos.nll_loss(log_probs, {"response_mask": mask})
    assert loss.item() == pytest.approx((1 + 2 + 0.5) / 3) and metrics == {}
