"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

With log-ratio  d_t = log pi(y_t) - log pi_ref(y_t):

    k1 = d_t                          unbiased, can be negative, high variance
    k2 = d_t^2 / 2                    biased, non-negative, low variance
    k3 = exp(-d_t) - 1 + d_t          unbiased, non-negative, low variance

All are differentiable in `logprobs` (the policy being trained); `ref_logprobs` is constant.
"""

from __future__ import annotations

from typing import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = pi_ref / pi - 1 - log(pi_ref / pi)."""
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL estimate named `estimator` (k1 | k2 | k3)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is unknown; choose one of "
                         f"{sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
