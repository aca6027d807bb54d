"""Returns and advantages over the trained tokens of padded [B, L] sequences.

All inputs are in next-token alignment (see `areal_like.algorithms.actors.base`): position t
is the action "generate token t+1" taken in state s_t (the prefix up to token t); `mask[b, t]`
says whether that action is trained, `rewards[b, t]` is its reward and `values[b, t]` the
critic's V(s_t). Untrained positions between actions (the prompt, tool outputs, the
environment's turns in a multi-step agent) are skipped: the "next" action of position t is
the next trained position of the same row, and the discount applies once per trained action.
After the last trained action the episode ends (value 0).

    discounted return:  G_t = r_t + gamma * G_next
    GAE:                delta_t = r_t + gamma * V_next - V_t
                        A_t = delta_t + gamma * lambda * A_next,   returns_t = A_t + V_t

Rewards on untrained positions are rejected by the reward-shaping step before this point.
"""

from __future__ import annotations

from typing import Optional

import torch


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t over trained positions (0 elsewhere), float64 [B, L]."""
    advantages, _ = gae_advantages(rewards, None, mask, gamma, 1.0)
    return advantages


def gae_advantages(
    rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), float64 [B, L], 0 on untrained positions.

    `values` None means V = 0 everywhere (then advantages = returns = lambda-returns of the
    rewards; with lam = 1 these are the discounted returns)."""
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} differ")
    r = rewards.to(torch.float64)
    v = torch.zeros_like(r) if values is None else values.to(torch.float64).detach()
    if v.shape != r.shape:
        raise ValueError(f"values {tuple(v.shape)} must match rewards {tuple(r.shape)}")
    m = mask.bool()
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a_t, 0.0)
        next_adv = torch.where(mt, a_t, next_adv)
        next_value = torch.where(mt, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def broadcast_to_tokens(scores: torch.Tensor, mask: torch.Tensor,
                        discount: float = 1.0) -> torch.Tensor:
    """[B] per-sequence scores -> [B, L] float64 on trained positions (0 elsewhere).

    With `discount` < 1 the score is the reward of the last trained action, discounted back
    along the response: position t gets discount**k * score, k the trained actions after t
    (the returns of the score at the last token, as seed 002's cumulative returns)."""
    m = mask.bool()
    s = scores.to(torch.float64)[:, None].expand(m.shape)
    if discount != 1.0:
        after = m.flip(-1).long().cumsum(-1).flip(-1) - m.long()  # trained actions after t
        s = s * torch.pow(torch.tensor(discount, dtype=torch.float64, device=s.device), after)
    return torch.where(m, s, 0.0)
