"""The train/inference gap of a batch, measured before every update.

d_t = log pi_prox(y_t) - log pi_behav(y_t) on the trained tokens: the trainer's recomputed
log-prob against the one the server returned with the token. With fresh tokens (lag 0: sampled
by the weights the trainer holds) the gap is numerics alone (kernels, dtypes, batch shapes);
older tokens add the policy's change since (lag = trainer version - token version).

Recorded under `<scope>/gap/` (avg/min/max over the batch's trained tokens, all ranks):

    abs_log_diff    |d_t|
    k3              w - 1 - log w, w = exp(d_t): KL(pi_behav || pi_prox), sampled from behav
    imp_weight      w_t, the decoupled weight before any cap or correction
    seq_imp_weight  exp(mean_t d_t) per sequence (the geometric mean, what mis_seq bounds)
    <name>_masked   the share of tokens correction <name> would drop (mis_token, mis_seq,
                    icepop), with the configured bounds for the configured one, else defaults
    tis_truncated   the share of tokens whose weight tis would truncate
    lag<k>/abs_log_diff, lag<k>/k3   the same, for tokens k versions old (k = 0, 1, 2, 3+)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from areal_like.algorithms.corrections import (
    correction_bounds,
    kept_by,
    log_weights,
    row_segments,
)
from areal_like.algorithms.functional import segment_mean
from areal_like.api.algorithm_config import CORRECTION_BOUNDS

if TYPE_CHECKING:
    from areal_like.api.algorithm_config import OffPolicyConfig

LAGS = 4  # lags 0, 1, 2 and 3+ (older tokens pooled)
MASKING = [name for name in CORRECTION_BOUNDS if name not in ("none", "tis")]


def k3_of_log_weights(log_w: torch.Tensor) -> torch.Tensor:
    """w - 1 - log w of w = exp(log_w), in float64 through expm1: in float32, exp(d) - 1 - d
    cancels below |d| ~ 1e-4 (3e-9 reported where the value is 5e-12, and negative values)."""
    d = log_w.double()
    return torch.expm1(d) - d


def record_gap(tracker: Any, behav: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor,
               lag: Optional[torch.Tensor], config: OffPolicyConfig) -> None:
    """Record the gap of padded [B, L] next-token-aligned log-probs (see the module doc);
    `lag` [B, L]: how many versions behind the trainer each token is (None: unknown, no
    per-lag split)."""
    flat_mask, cu = row_segments(mask.bool())
    record_gap_packed(tracker, behav.reshape(-1), prox.reshape(-1), flat_mask, cu,
                      None if lag is None else lag.reshape(-1), config)


def record_gap_packed(tracker: Any, behav: torch.Tensor, prox: torch.Tensor,
                      mask: torch.Tensor, cu_seqlens: torch.Tensor, lag: Optional[torch.Tensor],
                      config: OffPolicyConfig) -> None:
    """`record_gap` of packed [T] log-probs (sequences by `cu_seqlens`), e.g. a micro-batch's
    inside the loss, where the update's own forward gives the proximal log-probs."""
    flat_mask = mask.bool()
    cu = cu_seqlens
    log_w = log_weights(prox.float(), behav.float(), flat_mask)
    w = torch.exp(log_w)
    per_token = {
        "abs_log_diff": log_w.abs(),
        "k3": k3_of_log_weights(log_w),
        "imp_weight": w,
    }
    for name in MASKING:
        low, high = correction_bounds(config, name)
        dropped = flat_mask & ~kept_by(name, log_w, flat_mask, cu, low, high)
        per_token[f"{name}_masked"] = dropped.float()
    _, cap = correction_bounds(config, "tis")
    assert cap is not None
    per_token["tis_truncated"] = (flat_mask & (w > cap)).float()
    seq_log_w, n_trained = segment_mean(log_w, flat_mask, cu)
    with tracker.scope("gap"):
        tracker.denominator(gap_tokens=flat_mask, gap_seqs=n_trained > 0)
        tracker.stat(denominator="gap_tokens", **per_token)
        tracker.stat(denominator="gap_seqs", seq_imp_weight=torch.exp(seq_log_w))
        if lag is None:
            return
        for k in range(LAGS):
            name = f"lag{k}" if k < LAGS - 1 else f"lag{k}+"
            at = flat_mask & ((lag == k) if k < LAGS - 1 else (lag >= k))
            tracker.denominator(**{f"{name}_tokens": at})
            tracker.stat(denominator=f"{name}_tokens",
                         **{f"{name}/abs_log_diff": per_token["abs_log_diff"],
                            f"{name}/k3": per_token["k3"]})
