"""Train/inference corrections of the decoupled importance weight, chosen by name.

Tokens were sampled by the inference server (behaviour policy, log-prob `behav`); the trainer
recomputes them (proximal policy, `prox`). Decoupled PPO weights each token's loss by

    w_t = pi_prox(y_t) / pi_behav(y_t)      (tokens above off_policy.behav_imp_weight_cap: 0)

`algorithm.off_policy.correction` changes that weight (bounds: `correction_low` /
`correction_high`; None: the defaults, `CORRECTION_BOUNDS` in api/algorithm_config.py):

    none       w_t
    tis        min(w_t, C)                                     truncated IS (Yao et al. 2025)
    mis_token  w_t if low <= w_t <= high, else 0               masked IS, per token
    mis_seq    w_t if low <= exp(mean_t log w_t) <= high       masked IS, per sequence
               (geometric mean over the sequence's trained tokens), else 0 for the whole
               sequence (Liu et al. 2025; the [0.9, 1.1] default is ours)
    icepop     w_t if alpha <= w_t <= beta, else 0             two-sided token mask (IcePop,
               Ring-1T; alpha = 0.5, beta = 5)

A masked token contributes nothing to the loss; the aggregation still counts it (a mask is a
zero weight, as the behaviour cap has always been). Every function takes packed [T] tensors
with `cu_seqlens`; padded [B, L] data is the special case of rows as sequences
(`row_segments`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from areal_like.algorithms.functional import segment_ids, segment_mean
from areal_like.algorithms.losses import (
    LOG_RATIO_LIMIT,
    behaviour_importance_weights,
    masked_inputs,
)
from areal_like.api.algorithm_config import CORRECTION_BOUNDS

if TYPE_CHECKING:
    from areal_like.api.algorithm_config import OffPolicyConfig

TOKEN_LEVEL = ("tis", "mis_token", "icepop")  # the corrections that weight tokens one by one


def correction_bounds(config: OffPolicyConfig,
                      name: Optional[str] = None) -> tuple[Optional[float], Optional[float]]:
    """(low, high) of correction `name` (default: the configured one): the configured bounds
    for the configured correction, the defaults for any other."""
    name = config.correction if name is None else name
    low, high = CORRECTION_BOUNDS[name]
    if name == config.correction:
        low = config.correction_low if config.correction_low is not None else low
        high = config.correction_high if config.correction_high is not None else high
    return low, high


def log_weights(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w_t = log pi_prox - log pi_behav on trained tokens (0 elsewhere, NaN/inf there never
    read), clamped like every log-ratio of the losses."""
    m = mask.bool()
    prox, behav = masked_inputs(m, prox.detach(), behav.detach())
    return torch.where(m, prox - behav, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def sequence_log_weights(log_w: torch.Tensor, mask: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T]: each token's sequence mean of log w over trained tokens (the log of the geometric
    mean weight); 0 for tokens past the last sequence."""
    means, _ = segment_mean(log_w, mask, cu_seqlens)
    ids = segment_ids(cu_seqlens, log_w.shape[0])
    return torch.cat([means, means.new_zeros(1)])[ids]


def kept_by(name: str, log_w: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
            low: Optional[float], high: Optional[float]) -> torch.Tensor:
    """[T] bool: the trained tokens correction `name` keeps (tis keeps them all)."""
    m = mask.bool()
    if name in ("none", "tis"):
        return m
    x = sequence_log_weights(log_w, m, cu_seqlens) if name == "mis_seq" else log_w
    inside = torch.ones_like(m)
    if low is not None:
        inside &= x >= torch.log(torch.tensor(low, dtype=x.dtype))
    if high is not None:
        inside &= x <= torch.log(torch.tensor(high, dtype=x.dtype))
    return m & inside


def corrected_weights(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor,
                      cu_seqlens: torch.Tensor,
                      config: OffPolicyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [T], kept [T] bool) of the configured correction, on top of the behaviour cap;
    the weight is 0 wherever a token is not kept."""
    m = mask.bool()
    w, kept = behaviour_importance_weights(prox, behav, m, config.behav_imp_weight_cap)
    if config.correction == "none":  # the default: decoupled PPO's weight as it was
        return w, kept
    log_w = log_weights(prox, behav, m)
    low, high = correction_bounds(config)
    if config.correction == "tis":
        assert high is not None
        w = w.clamp(max=high)
    kept = kept & kept_by(config.correction, log_w, m, cu_seqlens, low, high)
    return torch.where(kept, w, torch.zeros_like(w)), kept


def row_segments(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded [B, L] data as packed: (the mask flattened to [B * L], cu_seqlens of B rows)."""
    b, length = mask.shape
    cu = torch.arange(0, b * length + 1, length, device=mask.device)
    return mask.reshape(-1), cu
