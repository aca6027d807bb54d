"""`action_norm`: Mem-alpha's advantage for multi-action agents.

An action is a contiguous run of trained tokens (one generated turn); its reward r_a is the sum
of the token rewards in the run (a workflow places it on the run's last token). Every action of
the step's batch (all ranks) is normalised together,

    A_a = (r_a - mean_batch r) / (sigma_batch r + eps),    sigma = population std,

with A_a = 0 when all actions' rewards are equal (Mem-alpha takes sigma = 1 there: the same
result), and A_a applies to every token of action a.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal_like.algorithms.estimators import AdvantageInputs, AdvantageOutputs
from areal_like.algorithms.normalize import normalize
from areal_like.algorithms.registry import register_advantage_estimator

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig


def action_spans(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] long: 1, 2, ... numbering the contiguous trained runs of each row, 0 elsewhere."""
    mask = loss_mask.bool()
    prev = torch.zeros_like(mask)
    prev[:, 1:] = mask[:, :-1]
    starts = mask & ~prev
    return torch.where(mask, starts.long().cumsum(-1), 0)


@register_advantage_estimator("action_norm", group_based=False, kl_placement="token",
                              discounted=False)
def action_norm(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    span = action_spans(inputs.loss_mask)
    n_spans = int(span.max()) if span.numel() else 0
    rewards = torch.where(inputs.loss_mask.bool(), inputs.token_rewards.double(), 0.0)
    # per action: the summed reward, at slot (row, action index)
    per_action = torch.zeros(span.shape[0], n_spans + 1, dtype=torch.float64,
                             device=rewards.device).scatter_add(1, span, rewards)[:, 1:]
    exists = torch.zeros(span.shape[0], n_spans + 1, dtype=torch.long, device=span.device
                         ).scatter_add(1, span, inputs.loss_mask.long())[:, 1:] > 0
    scores = normalize(per_action, exists, None, mean=True, std=True, eps=config.norm.eps,
                       all_reduce=inputs.all_reduce)
    padded = torch.cat([torch.zeros_like(scores[:, :1]), scores], dim=1)
    adv = torch.where(inputs.loss_mask.bool(), padded.gather(1, span), 0.0)
    return AdvantageOutputs(adv)
