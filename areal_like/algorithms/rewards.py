"""Reward shaping: scale, bias, clip, the DAPO overlong-length penalty, and placing rewards on
tokens.

A trajectory's `rewards` is either one number per sequence [B] (an outcome reward) or a
dense [B, L] tensor in token alignment: rewards[b, t] rewards the action of generating token
t (e.g. a process reward model scoring the last token of each reasoning step, or a multi-step
agent's per-action rewards at action boundaries). Dense rewards may only sit on tokens where
`loss_mask` is 1.

Shaping of one reward event r of a sequence with response length n:

    r' = clip((r + bias + overlong(n)) * scale, -reward_clip, reward_clip)

where `bias` and `overlong` are added once per sequence, to its outcome reward ([B] case)
or to the reward of its last trained token (dense case); `scale` and the clip apply to every
event. DAPO's soft overlong punishment, with L_max = max_response_tokens and
L_cache = overlong_tokens:

    overlong(n) = 0                                       if n <= L_max - L_cache
                = (L_max - L_cache - n) / L_cache * factor if L_max - L_cache < n <= L_max
                = -factor                                 if n > L_max
"""

from __future__ import annotations

from typing import Optional

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_tokens: int,
                     overlong_tokens: int, penalty_factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment per sequence (<= 0), see the module docstring."""
    if not 0 < overlong_tokens <= max_response_tokens:
        raise ValueError(f"overlong_tokens={overlong_tokens} must be in (0, max_response_tokens="
                         f"{max_response_tokens}]")
    expected = max_response_tokens - overlong_tokens
    exceed = response_lengths.to(torch.float64) - expected
    penalty = -exceed.clamp(min=0) / overlong_tokens * penalty_factor
    return penalty.clamp(min=-penalty_factor)


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] column of the last token with loss_mask 1 in each row; -1 for rows without one."""
    m = loss_mask.bool()
    cols = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, cols, torch.full_like(cols, -1)).max(dim=1).values


def place_at_last_token(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, L]: each value at its row's last trained token (rows without one: dropped)."""
    idx = last_token_index(loss_mask)
    out = torch.zeros(loss_mask.shape, dtype=values.dtype, device=values.device)
    rows = torch.nonzero(idx >= 0).squeeze(-1)
    out[rows, idx[rows]] = values[rows]
    return out


def shape_rewards(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    scale: float = 1.0,
    bias: float = 0.0,
    clip: float = float("inf"),
    overlong: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape `rewards` ([B] or dense [B, L], token alignment) and put them on tokens.

    `overlong` is an optional [B] per-sequence penalty (see `overlong_penalty`). Returns
    (token_rewards [B, L] float64 in token alignment, sequence totals [B] float64).
    """
    mask = loss_mask.bool()
    b = mask.shape[0]
    extra = torch.full((b,), float(bias), dtype=torch.float64, device=rewards.device)
    if overlong is not None:
        extra = extra + overlong.to(torch.float64)
    if rewards.shape == (b,):
        seq = ((rewards.to(torch.float64) + extra) * scale).clamp(-clip, clip)
        return place_at_last_token(seq, mask), seq
    if rewards.shape != mask.shape:
        raise ValueError(f"'rewards' has shape {tuple(rewards.shape)}; expected ({b},) or "
                         f"{tuple(mask.shape)} like 'loss_mask'")
    dense = rewards.to(torch.float64)
    stray = (dense != 0) & ~mask
    if stray.any():
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"'rewards'[{row}, {col}] = {float(dense[row, col])} sits on a token with loss_mask "
            "0; dense rewards must be placed on generated (trained) tokens"
        )
    tokens = ((dense + place_at_last_token(extra, mask)) * scale).clamp(-clip, clip)
    tokens = torch.where(mask, tokens, torch.zeros_like(tokens))
    return tokens, tokens.sum(-1)
