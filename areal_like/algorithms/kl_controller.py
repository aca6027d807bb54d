"""The coefficient of the KL-to-reference penalty: fixed, or adapted to a target KL.

The adaptive controller of Ziegler et al. (2019), as OpenRLHF and LightRFT use it: after every
training step, with the KL observed on that step's batch (mean over its sequences of each
sequence's mean token KL) and n = the number of sequences in the batch,

    e     = clip(KL / kl_target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n / kl_horizon)

so beta grows while the policy drifts beyond the target and shrinks while it stays within.
"""

from __future__ import annotations

import math
from typing import Any, Optional


class KLController:
    """Holds the current coefficient `value`; `update` is called once per training step."""

    def __init__(self, init_coef: float, target: Optional[float] = None,
                 horizon: int = 10000) -> None:
        if init_coef < 0:
            raise ValueError(f"kl_ctl={init_coef} must be >= 0")
        if target is not None and not target > 0:
            raise ValueError(f"kl_target={target} must be > 0 (or None: a fixed coefficient)")
        if horizon < 1:
            raise ValueError(f"kl_horizon={horizon} must be >= 1")
        self.value = float(init_coef)
        self.target = target
        self.horizon = horizon
        self.n_updates = 0

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt to the KL `current_kl` observed over `n_steps` samples; returns the new value.
        A fixed controller keeps its value."""
        if not math.isfinite(current_kl):
            raise ValueError(f"observed KL {current_kl} is not finite; cannot adapt kl_ctl")
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps} must be >= 0")
        self.n_updates += 1
        if self.target is None:
            return self.value
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + error * n_steps / self.horizon
        if mult <= 0:
            raise ValueError(f"kl_horizon={self.horizon} is too short for {n_steps} samples a "
                             f"step: the coefficient would turn <= 0 (need kl_horizon > "
                             f"0.2 * samples per step)")
        self.value *= mult
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon,
                "n_updates": self.n_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient; the target and horizon stay as configured (a resumed run
        may change them on purpose)."""
        self.value = float(state["value"])
        self.n_updates = int(state["n_updates"])
