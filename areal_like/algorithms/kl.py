"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

With log-ratio  d_t = log pi(y_t) - log pi_ref(y_t):

    k1 = d_t                          unbiased, can be negative, high variance
    k2 = d_t^2 / 2                    biased, non-negative, low variance
    k3 = exp(-d_t) - 1 + d_t          unbiased, non-negative, low variance

All are differentiable in `logprobs` (the policy being trained); `ref_logprobs` is constant.
`kl_full` is the exact KL at one position from both next-token distributions (no sampling).
"""

from __future__ import annotations

import math
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


def kl_full(logp_all: torch.Tensor, ref_top_ids: torch.Tensor,
            ref_top_logp: torch.Tensor) -> torch.Tensor:
    """Per position t, KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)) over the whole
    vocabulary: `logp_all` [T, V] the policy's log-softmax (differentiable); pi_ref known on its
    k most likely tokens (`ref_top_ids`, `ref_top_logp` [T, k], distinct ids per position), the
    rest of its mass spread evenly over the other V - k tokens (exact when k = V)."""
    n_vocab, k = logp_all.shape[-1], ref_top_ids.shape[-1]
    if ref_top_ids.shape != ref_top_logp.shape or ref_top_ids.shape[:-1] != logp_all.shape[:-1]:
        raise ValueError(f"kl_full: ref_top_ids {tuple(ref_top_ids.shape)} and ref_top_logp "
                         f"{tuple(ref_top_logp.shape)} must both be [T, k] for T = "
                         f"{logp_all.shape[0]}")
    if k > n_vocab or (ref_top_ids.numel() and not 0 <= int(ref_top_ids.min())
                       <= int(ref_top_ids.max()) < n_vocab):
        raise ValueError(f"kl_full: ref_top_ids holds ids outside the policy's vocabulary "
                         f"[0, {n_vocab}) or k={k} > {n_vocab}: the reference must share the "
                         f"policy's tokenizer")
    top = ref_top_logp.to(logp_all.dtype)
    rest = (-torch.expm1(torch.logsumexp(top, dim=-1))).clamp(min=1e-30)  # 1 - top-k mass
    fill = torch.log(rest) - math.log(max(n_vocab - k, 1))
    ref = fill[..., None].expand_as(logp_all).scatter(-1, ref_top_ids, top)
    return (logp_all.exp() * (logp_all - ref)).sum(-1)
