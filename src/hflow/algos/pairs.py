"""Losses and metrics on preference pairs: reward and cost models', and the policy's own under DPO and IPO.

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


# ---------------------------------------------------------------- direct preference optimisation

DPO_LOSSES = ("sigmoid", "ipo")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, loss: str = "sigmoid",
             chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair DPO / IPO losses [B] from each response's summed log-prob under the policy and
    the reference (all [B]), with the implicit reward h = log π(y|x) − log π_ref(y|x):

        sigmoid (DPO, Rafailov et al. 2023):  L = −log σ(β (h_chosen − h_rejected))
        ipo (Azar et al. 2023, eq. 17):       L = (h_chosen / n_chosen − h_rejected / n_rejected − 1 / (2β))²

    IPO's log-ratios are averaged over each response's tokens (`chosen_tokens`, `rejected_tokens`:
    the response lengths, at least 1 counted), as TRL's DPOTrainer does, so that β means the same
    whatever the lengths. The mean over pairs is the batch loss."""
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss == "sigmoid":
        return -F.logsigmoid(beta * (chosen - rejected))
    if loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss averages over the response tokens: give chosen_tokens and rejected_tokens")
        delta = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * beta)).square()
    raise ValueError(f"unknown DPO loss {loss!r}; choose one of {DPO_LOSSES}")


def dpo_metrics(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float) -> dict[str, float]:
    """TRL's DPO figures (means over pairs; the same for either loss): rewards/chosen and
    rewards/rejected, the implicit rewards β (log π − log π_ref) of the summed log-probs;
    rewards/accuracies, the share of pairs whose chosen reward is higher (a tie counts as
    wrong); rewards/margins, chosen − rejected; logps/chosen and logps/rejected, the policy's."""
    chosen = beta * (policy_chosen - ref_chosen).detach().float()
    rejected = beta * (policy_rejected - ref_rejected).detach().float()
    return {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).float().mean().item(),
            "rewards/margins": (chosen - rejected).mean().item(),
            "logps/chosen": policy_chosen.detach().float().mean().item(),
            "logps/rejected": policy_rejected.detach().float().mean().item()}


def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob [B], token count [B]) of each response from per-token log-probs [B, R]
    and its 0/1 mask (values outside the mask are ignored, even NaN)."""
    mask = response_mask[:, :log_probs.shape[1]].bool()
    return torch.where(mask, log_probs, 0.0).sum(-1), mask.sum(-1).to(log_probs.dtype)


def dpo_pair_loss(log_probs: torch.Tensor, mb, *, beta: float = 0.1, loss: str = "sigmoid", entropy=None):
    """The loss Actor.update minimises on a micro-batch of pairs (rows 2i chosen, 2i + 1
    rejected, as hflow.data.preference.pair_batch lays them out) that carries each row's
    reference log-prob summed over its response, `ref_logp` [b]: the mean over its pairs of
    `dpo_loss`, and `dpo_metrics`."""
    if not bool((mb["chosen"][0::2] == 1).all() and (mb["chosen"][1::2] == 0).all()):
        raise ValueError("a micro-batch is not in pair layout (rows 2i chosen, 2i+1 rejected)")
    logp, tokens = sequence_log_probs(log_probs, mb["response_mask"])
    ref = mb["ref_logp"].to(logp.dtype)
    per_pair = dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], beta, loss, tokens[0::2], tokens[1::2])
    return per_pair.mean(), dpo_metrics(logp[0::2], logp[1::2], ref[0::2], ref[1::2], beta)
