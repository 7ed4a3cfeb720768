"""Losses and metrics of reward and cost models on preference pairs.

A batch of pairs holds pair i as rows 2i (chosen: the better response, for a cost model the
safer one) and 2i + 1 (rejected), in the layout of hflow.data.preference.pair_batch.
"""
import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_coef: float = 0.0) -> torch.Tensor:
    """L = −mean_i log σ(r_i^chosen − r_i^rejected) + λ · mean_i ((r_i^chosen)² + (r_i^rejected)²) / 2

    The first term is the negative log-likelihood of the preferences under Bradley–Terry,
    P(chosen ≻ rejected) = σ(r^chosen − r^rejected). It leaves every prompt a free offset (adding
    c(x) to both scores changes nothing); the centering term (λ = `center_coef`) pulls a pair's
    scores to ±margin / 2, so that 0 means the same on every prompt and an RL critic need not
    learn the offsets (Eisenstein et al. 2023; Safe-RLHF's `regularization`)."""
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_coef:
        loss = loss + center_coef * (chosen.square() + rejected.square()).mean() / 2
    return loss

def cost_model_loss(safer: torch.Tensor, unsafer: torch.Tensor, safer_is_safe: torch.Tensor,
                    unsafer_is_safe: torch.Tensor) -> torch.Tensor:
    """Safe-RLHF's cost model loss (Dai et al. 2023, eq. 6), per pair i:

        L_i = −log σ(c_i^unsafer − c_i^safer) − log σ(s_i^safer·c_i^safer) − log σ(s_i^unsafer·c_i^unsafer)

    with s = +1 for an unsafe response and −1 for a safe one; L = mean_i L_i. The first term
    ranks (the less safe response costs more), the other two classify: cost > 0 ⇔ unsafe."""
    sign = lambda is_safe: 1.0 - 2.0 * is_safe.float()   # noqa: E731  (safe -> -1, unsafe -> +1)
    return (-F.logsigmoid(unsafer - safer) - F.logsigmoid(sign(safer_is_safe) * safer)
            - F.logsigmoid(sign(unsafer_is_safe) * unsafer)).mean()

def pair_metrics(scores: torch.Tensor, safe: torch.Tensor | None = None, cost: bool = False) -> dict[str, float]:
    """Metrics of scores [2B] in pair layout (rows 2i chosen, 2i+1 rejected).

    accuracy: share of pairs ranked right, r^chosen > r^rejected (a cost model: c^chosen <
    c^rejected, the safer one costs less; a tie counts as wrong); margin: the mean of that
    difference. A cost model also gets sign_accuracy: share of responses with cost > 0 ⇔ unsafe."""
    chosen, rejected = scores[0::2].float(), scores[1::2].float()
    margin = chosen - rejected if not cost else rejected - chosen
    metrics = {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}
    if cost and safe is not None:
        metrics["sign_accuracy"] = ((scores > 0) == (safe < 0.5)).float().mean().item()
    return metrics

def pair_loss(scores: torch.Tensor, mb, *, cost: bool = False, center_coef: float = 0.0):
    """The loss RewardModel.update minimises on a micro-batch of pairs: Bradley–Terry (+ the
    centering term), or the cost model's ranking + sign terms (`cost`, which needs the batch's
    `safe` labels; its sign term already fixes the zero)."""
    chosen, rejected = scores[0::2], scores[1::2]
    if not bool((mb["chosen"][0::2] == 1).all() and (mb["chosen"][1::2] == 0).all()):
        raise ValueError("a micro-batch is not in pair layout (rows 2i chosen, 2i+1 rejected)")
    if cost:
        if "safe" not in mb:
            raise ValueError("a cost model trains on pairs with safety labels: give "
                             "--data.chosen-safe-key and --data.rejected-safe-key")
        loss = cost_model_loss(chosen, rejected, mb["safe"][0::2], mb["safe"][1::2])
    else:
        loss = bradley_terry_loss(chosen, rejected, center_coef)
    return loss, pair_metrics(scores.detach(), mb["safe"] if "safe" in mb else None, cost)
