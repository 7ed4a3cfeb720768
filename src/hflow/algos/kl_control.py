"""KL coefficient controllers: β in r_t = score_t − β·KL_t, fixed or adapted to a target."""


class FixedKLController:
    """β stays `kl_coef`. `update` is a no-op, so recipes can call it unconditionally."""

    def __init__(self, kl_coef):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])

class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"):

    err = clip(KL / target − 1, −0.2, 0.2),  β ← β·(1 + err·n_steps / horizon)
    where KL is the measured mean KL of the last batch and n_steps its number of samples.
    """

    def __init__(self, init_kl_coef, target_kl, horizon):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self):
        # only β is state; target and horizon are configuration and come from the flags
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])
