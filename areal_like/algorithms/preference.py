"""Pairwise preference losses, per pair: Bradley-Terry for reward models, DPO (sigmoid with
label smoothing, IPO), and the packed-micro-batch pieces they read (which rows pair up, a
sequence's reward at its last token, a response's log-probability).

    r = reward(prompt + response)                 (a scalar head's output at the last token)
    BT:       -log sigmoid(r_c - r_r - margin)
    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))
    DPO:      -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    IPO:      (h - 1 / (2 beta))^2                (log-probs as per-token means, by the caller)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from areal_like.algorithms.functional import segment_sum


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                       margin: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[P] per-pair losses -log sigmoid(r_c - r_r - margin)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> torch.Tensor:
    """[P] per-pair DPO losses from response log-probabilities (sums for sigmoid; per-token
    means for IPO)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        return (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"dpo loss_type={loss_type!r}: expected 'sigmoid' or 'ipo'")


def pair_rows(mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence indices of a packed micro-batch's pairs: its rows are
    pairs, chosen then rejected (`data.preference.build_pair_batch`; the engine keeps a
    `loss_group_id` in one micro-batch)."""
    ids, chosen = mb["loss_group_id"].reshape(-1), mb["is_chosen"].reshape(-1).bool()
    n = ids.numel()
    if n % 2 or not (bool(chosen[0::2].all()) and not bool(chosen[1::2].any())
                     and bool((ids[0::2] == ids[1::2]).all())):
        raise ValueError(f"a micro-batch's rows are not (chosen, rejected) pairs: "
                         f"loss_group_id={ids.tolist()}, is_chosen={chosen.tolist()}")
    index = torch.arange(n, device=ids.device)
    return index[0::2], index[1::2]


def last_token_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] per-token outputs -> [n_seqs] the output at each sequence's last token."""
    return values[cu_seqlens[1:] - 1]


def response_logprobs(logp: torch.Tensor, loss_mask: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n_seqs] sum of the masked next-token log-probs, [n_seqs] their count)."""
    mask = loss_mask.bool()
    sums = segment_sum(torch.where(mask, logp, torch.zeros_like(logp)), cu_seqlens)
    return sums, segment_sum(mask.to(logp.dtype), cu_seqlens)
