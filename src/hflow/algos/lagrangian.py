"""Safe-RLHF's Lagrange multiplier (Dai et al. 2023): λ learned in log space against a cost
threshold, and the advantage of the Lagrangian it weighs."""
import math


def update_log_lambda(log_lambda: float, mean_cost: float, threshold: float, lr: float,
                      lambda_max: float = 0.0) -> float:
    """log λ' = log λ + lr·λ·(J_C − d), then log λ' ≤ log λ_max (λ_max > 0). One SGD step on the
    multiplier's loss −λ·(J_C − d) with λ = exp(log λ) (Dai et al. 2023, eq. 31): λ grows while
    the mean cost J_C is above the threshold d, shrinks below it, and never leaves 0."""
    value = log_lambda + lr * math.exp(log_lambda) * (mean_cost - threshold)
    return min(value, math.log(lambda_max)) if lambda_max > 0 else value


def lagrangian_advantages(reward_advantages, cost_advantages, multiplier: float):
    """A = (A_r − λ·A_c) / (1 + λ): the Lagrangian's advantage, scaled to a convex mix of A_r
    and −A_c so that its size stays bounded as λ grows."""
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


class LagrangeMultiplier:
    """λ = exp(log λ), a controller object checkpointed with the run."""

    def __init__(self, init: float, lr: float, lambda_max: float):
        self.log_value = math.log(init) if init > 0 else -math.inf
        self.lr, self.lambda_max = lr, lambda_max

    @property
    def value(self) -> float:
        return math.exp(self.log_value)

    def update(self, mean_cost: float, threshold: float) -> None:
        self.log_value = update_log_lambda(self.log_value, mean_cost, threshold, self.lr, self.lambda_max)

    def state_dict(self) -> dict:
        return {"log_value": self.log_value}

    def load_state_dict(self, state: dict) -> None:
        self.log_value = state["log_value"]
