"""Reductions over the masked-in tokens: means, whitening, loss aggregation, explained variance.

`mask` is 1 on the tokens a loss counts (the policy's own tokens) and 0 elsewhere (padding, and
tool or environment output inside a multi-turn response). Masked-out positions never influence a
result, even if they hold NaN or inf (they are selected away with `torch.where`, not multiplied
by 0), and a mean over nothing is 0.
"""
import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
_WHITEN_EPS = 1e-8


def masked_mean(x, mask, dim=None):
    """mean of x over the positions where mask = 1: sum(x·m) / sum(m)  (0 where sum(m) = 0).

    `dim=None` reduces everything to a 0-dim tensor; an int or tuple reduces those dims only.
    """
    m = torch.broadcast_to(mask.bool(), x.shape)
    total = torch.where(m, x, 0).sum(dim=dim)
    return total / m.sum(dim=dim).clamp(min=1)

def masked_whiten(x, mask, shift_mean=True):
    """(x − μ) / sqrt(σ² + 1e-8) over the masked-in positions; 0 at masked-out positions.

    μ and σ² are the masked mean and the unbiased masked variance (Σ(x−μ)²·m / (n − 1)).
    `shift_mean=False` adds μ back: the scale is normalised, the mean kept.
    """
    m = torch.broadcast_to(mask.bool(), x.shape)
    mean = masked_mean(x, m)
    centered = torch.where(m, x - mean, 0)
    var = centered.square().sum() / (m.sum() - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0)

def aggregate_loss(loss_mat, mask, agg="token-mean"):
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean:          Σ_bt L·m / Σ_bt m           (every token weighs the same; DAPO)
    seq-mean-token-sum:  (1/B) Σ_b Σ_t L·m          (Dr.GRPO-like: no length normalisation)
    seq-mean-token-mean: (1/B) Σ_b (Σ_t L·m / Σ_t m) (every sequence weighs the same; GRPO paper)
    A sequence with no masked-in token contributes 0 and still counts in B.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    m = torch.broadcast_to(mask.bool(), loss_mat.shape)
    per_token = torch.where(m, loss_mat, 0)
    if agg == "seq-mean-token-sum":
        return per_token.sum(-1).mean()
    if agg == "seq-mean-token-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGG_MODES}")


@torch.no_grad()
def explained_variance(values, returns, mask):
    """How much of the returns' spread the values predict (verl's critic/vf_explained_var):

    EV = 1 − Var(R − V) / Var(R)   over the masked-in tokens.
    1: V predicts R exactly; 0: no better than a constant; < 0: worse than one. A constant
    offset in V costs nothing (it is a variance of the error, not its mean square). Where the
    returns do not vary at all, EV is 1 if the error does not vary either, else 0 (as
    scikit-learn's explained_variance_score), not a division by 0. A Python float.
    """
    m = torch.broadcast_to(mask.bool(), returns.shape)

    def variance(x):   # the biased masked variance: the (n − 1) / n factors would cancel in the ratio
        return masked_mean((x - masked_mean(x, m)).square(), m)

    var_returns, var_error = variance(returns), variance(returns - values)
    if var_returns == 0:
        return 1.0 if var_error == 0 else 0.0
    return (1 - var_error / var_returns).item()
