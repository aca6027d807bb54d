"""Reducing per-token losses to the scalar a micro-batch returns, and its weight.

The train engine computes  loss = sum_mb w_mb * loss_mb / sum_mb w_mb  over all micro-batches
and ranks, with w_mb = `loss_weight(mb, mode)`. Each mode pairs a per-micro-batch reduction
with a weight so that this combination is the mode's formula over the *whole* batch.
Let l_{i,t} be the token losses, T_i the trained tokens of sequence i, N the number of
sequences with at least one trained token (sequences without one are ignored):

    token-mean            sum_i sum_{t in T_i} l_{i,t} / sum_i |T_i|        w = #trained tokens
    seq-mean-token-mean   (1/N) sum_i (1/|T_i|) sum_{t in T_i} l_{i,t}       w = N_mb
    seq-mean-token-sum    (1/N) sum_i sum_{t in T_i} l_{i,t}                 w = N_mb
    constant (Dr.GRPO)    sum_i sum_{t in T_i} l_{i,t} / (N * C)             w = N_mb

with C = `loss_agg_constant`: Dr.GRPO uses the generation budget (max new tokens), which
recipe configs fill in when it is left unset.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from areal_like.algorithms.functional import segment_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is unknown; choose one of {AGG_MODES}")


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                   mode: str, constant: Optional[float] = None) -> torch.Tensor:
    """Reduce packed [T] token losses of one micro-batch (see module docstring).

    A micro-batch with no trained token gives 0 (still connected to the graph)."""
    _check_mode(mode)
    if mode == "constant" and (constant is None or not constant > 0):
        raise ValueError(f"loss.agg_mode='constant' needs loss.agg_constant > 0 (the generation "
                         f"budget, max_new_tokens), got {constant!r}")
    m = mask.bool()
    masked = torch.where(m, token_loss, torch.zeros_like(token_loss))
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    seq_sum = segment_sum(masked, cu_seqlens)
    seq_cnt = segment_sum(m.to(token_loss.dtype), cu_seqlens)
    has_tokens = seq_cnt > 0
    n_seqs = has_tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sum / seq_cnt.clamp(min=1)).sum() / n_seqs
    assert constant is not None  # checked above
    return seq_sum.sum() / (n_seqs * constant)


class _Tensors(Protocol):
    """A TensorDict or a dict of tensors."""

    def __getitem__(self, key: str) -> torch.Tensor: ...


def loss_weight(micro_batch: _Tensors, mode: str, mask_key: str = "loss_mask") -> torch.Tensor:
    """The micro-batch's weight for `mode`: trained tokens (token-mean) or sequences with at
    least one trained token (the other modes). Accepts packed [T] data with `cu_seqlens`, or
    padded [B, L] data."""
    _check_mode(mode)
    m = micro_batch[mask_key].bool()
    if mode == "token-mean":
        return m.sum()
    if m.dim() == 2:
        return m.any(dim=1).sum()
    counts = segment_sum(m.to(torch.float32), micro_batch["cu_seqlens"])
    return (counts > 0).sum()
