"""Small tensor helpers shared by the algorithms: masked reductions, the next-token shift,
per-sequence reductions over packed data, and group ids.

Log-probabilities and entropies of taken tokens come from `areal_like.utils.packed_logprobs`
(`gather_logprobs`, `gather_logprobs_entropy`, `next_token_logprobs[_entropy]`), the same
chunked code the train engine uses; they are re-exported here for convenience.
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_like.utils.packed_logprobs import (
    gather_logprobs,
    gather_logprobs_entropy,
    next_token_labels,
    next_token_logprobs,
    next_token_logprobs_entropy,
    next_token_mask,
)

__all__ = [
    "gather_logprobs",
    "gather_logprobs_entropy",
    "group_index_from_ids",
    "masked_mean",
    "masked_sum",
    "next_token_labels",
    "next_token_logprobs",
    "next_token_logprobs_entropy",
    "next_token_mask",
    "segment_ids",
    "segment_mean",
    "segment_sum",
    "shift_to_next_token",
    "top_fraction_mask",
]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all dims when None). Masked-out entries never propagate NaN."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1): an empty mask gives 0, not NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def shift_to_next_token(x: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] -> [B, L, ...] with out[:, t] = x[:, t + 1] and out[:, L - 1] = 0.

    Moves a per-token quantity from token alignment (position t describes token t) to
    next-token alignment (position t describes the prediction of token t+1). Zero fill, not
    wrap-around: the last column never borrows a row's first token.
    """
    if x.dim() < 2:
        raise ValueError(f"shift_to_next_token needs a [B, L, ...] tensor, got {tuple(x.shape)}")
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def segment_ids(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[T] index of the packed sequence each token belongs to.

    Tokens past `cu_seqlens[-1]` (padding an engine may append) get index `n_seqs`, one past
    the last real sequence, so per-sequence reductions can drop them.
    """
    cu = cu_seqlens.long()
    n_seqs = cu.numel() - 1
    if n_seqs < 0 or int(cu[-1]) > n_tokens:
        raise ValueError(f"cu_seqlens {cu.tolist()} does not fit {n_tokens} packed tokens")
    lengths = torch.diff(cu)
    ids = torch.repeat_interleave(torch.arange(n_seqs, device=cu.device), lengths)
    pad = n_tokens - ids.numel()
    if pad:
        ids = torch.cat([ids, torch.full((pad,), n_seqs, dtype=torch.long, device=cu.device)])
    return ids


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] packed values -> [n_seqs] per-sequence sums (differentiable)."""
    ids = segment_ids(cu_seqlens, x.shape[0])
    n_seqs = cu_seqlens.numel() - 1
    out = torch.zeros(n_seqs + 1, dtype=x.dtype, device=x.device).index_add(0, ids, x)
    return out[:n_seqs]


def segment_mean(x: torch.Tensor, mask: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence masked mean [n_seqs], per-sequence mask count [n_seqs]) of packed `x`.

    A sequence with no masked-in token has mean 0."""
    m = mask.bool()
    sums = segment_sum(torch.where(m, x, torch.zeros_like(x)), cu_seqlens)
    counts = segment_sum(m.to(x.dtype), cu_seqlens)
    return sums / counts.clamp(min=1), counts


def top_fraction_mask(scores: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """Bool mask of the ceil(fraction * n) highest `scores` among the n masked-in entries.

    Used to train only on the highest-entropy tokens ("80/20" rule). fraction >= 1 returns
    `mask` unchanged; ties are broken by position (torch.topk)."""
    m = mask.bool()
    if fraction >= 1.0:
        return m
    n = int(m.sum())
    k = int(torch.ceil(torch.tensor(fraction * n)).item())
    out = torch.zeros_like(m)
    if k == 0:
        return out
    masked_scores = torch.where(m, scores.detach(), torch.full_like(scores, -float("inf")))
    idx = torch.topk(masked_scores.reshape(-1), k).indices
    out.view(-1)[idx] = True
    return out & m


def group_index_from_ids(group_ids: Optional[torch.Tensor], batch_size: int,
                         group_size: int) -> torch.Tensor:
    """[B] contiguous group index 0..G-1.

    From a `group_id`/`uid` tensor when given (any integer ids, in any order); otherwise
    consecutive rows form groups of `group_size` (the batch must be a multiple of it)."""
    if group_ids is not None:
        if group_ids.shape != (batch_size,):
            raise ValueError(f"'group_id' has shape {tuple(group_ids.shape)}; expected "
                             f"({batch_size},), one id per sequence")
        if group_ids.dtype.is_floating_point:
            raise ValueError(f"'group_id' has dtype {group_ids.dtype}; expected integer ids")
        return torch.unique(group_ids, return_inverse=True)[1]
    if batch_size % group_size:
        raise ValueError(
            f"batch of {batch_size} sequences is not a multiple of AlgorithmConfig.group_size="
            f"{group_size}; pass a 'group_id' key or fix group_size"
        )
    return torch.arange(batch_size) // group_size
