"""Advantage estimators, selectable by name (`algorithm.adv.estimator`).

Every estimator maps `AdvantageInputs` to `AdvantageOutputs` in next-token alignment. Notation:
r_i = total (shaped) reward of sequence i, g(i) its group (the samples of one prompt),
r_t = per-token reward, G_t = discounted return (`advantages.py`), sigma = population std,
eps = `norm.eps`. Outcome estimators give every trained token of a sequence the same
advantage; with adv.discount = gamma < 1 the score is discounted back from the last trained
token (gamma^k for k trained tokens after t, seed 002's returns of the shaped score).
`action_norm` does not discount and refuses gamma < 1.

    gae           A_t = GAE(gamma, lambda) with critic values           (dense rewards OK)
    reinforce     A_t = G_t                                              (dense rewards OK)
    reinforce_pp  A_t = (G_t - mean_batch G) / (sigma_batch G + eps)     (dense rewards OK)
                  over all trained tokens of the batch (all ranks); REINFORCE++ puts the token
                  KL into the reward: set kl.in_reward=True, kl.coef > 0 and give a reference.
    reinforce_baseline
                  A_t = whiten_batch(G_t of r'_t),  r'_t = r_t - [t last] * mean_g r
                  (LightRFT / REINFORCE++-baseline: the group mean removed from the outcome,
                  then normalised over all trained tokens of the batch, all ranks)
    grpo          A_i = (r_i - mean_g r) / (sigma_g r + eps); `adv.group_std` picks sigma:
    (group_norm)  population (default) or unbiased (n - 1, LightRFT's torch.std)
    dr_grpo       A_i = r_i - mean_g r
    rloo          A_i = r_i - mean_{j in g, j != i} r_j
    remax         A_i = r_i - b_i, b_i = shape(batch key `baseline_rewards`) [B], the raw
                  reward of the greedy completion of the same prompt shaped exactly like r_i
                  (same scale, bias, clip; the actor shapes it); without the key A_i = r_i
    cpgd          A_i = (r_i - mean_g r) * w_i, w = clip-filter weight (`normalize.py`)

KL in the reward (kl.in_reward, kl.coef > 0), in the order OpenRLHF and LightRFT use: the
outcome estimators (grpo, dr_grpo, rloo, remax, cpgd; `kl_placement="outcome"`) see the shaped
outcome rewards only; the actor normalises their advantages and applies clip-filter weights,
then adds the penalty's return-to-go  -kl.coef * sum_{t' >= t} gamma_kl^(t'-t) KL_t',
gamma_kl = kl.discount (unset: adv.discount; 0: each token's own KL).
The token estimators (gae, reinforce, reinforce_pp) take the penalty inside r_t, which is
their definition (REINFORCE++).

A group whose rewards are all equal (including a single-sample group) gets A = 0 from every
group estimator. Per-action rewards of multi-step agents enter as dense token rewards; the
outcome estimators use their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from areal_like.algorithms.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
)
from areal_like.algorithms.normalize import clip_filter_weights, normalize
from areal_like.algorithms.registry import register_advantage_estimator
from areal_like.algorithms.rewards import place_at_last_token

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig


@dataclass
class AdvantageInputs:
    """What an estimator may use; every [B, L] tensor is in next-token alignment."""

    token_rewards: torch.Tensor  # [B, L] float64 shaped rewards, 0 where loss_mask is 0
    seq_rewards: torch.Tensor  # [B] float64 total shaped reward per sequence
    loss_mask: torch.Tensor  # [B, L] bool, trained actions
    group_index: torch.Tensor  # [B] long in 0..G-1 (samples of the same prompt share one)
    values: Optional[torch.Tensor] = None  # [B, L] critic V(s_t)
    baseline_rewards: Optional[torch.Tensor] = None  # [B] shaped like seq_rewards (remax)
    all_reduce: bool = False  # batch-wide statistics pool over distributed ranks


@dataclass
class AdvantageOutputs:
    advantages: torch.Tensor  # [B, L], 0 where loss_mask is 0
    returns: Optional[torch.Tensor] = None  # [B, L] value targets (critic), when defined


def _require(value: Optional[torch.Tensor], name: str, estimator: str, hint: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"adv_estimator={estimator!r} needs batch key {name!r} ({hint})")
    return value


@register_advantage_estimator("gae", group_based=False, kl_placement="token")
def gae(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    values = _require(inputs.values, "values", "gae", "critic values from CriticActor."
                      "compute_values")
    adv, ret = gae_advantages(inputs.token_rewards, values, inputs.loss_mask,
                              config.adv.discount, config.adv.gae_lambda)
    return AdvantageOutputs(adv, ret)


@register_advantage_estimator("reinforce", group_based=False, kl_placement="token")
def reinforce(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    ret = discounted_returns(inputs.token_rewards, inputs.loss_mask, config.adv.discount)
    return AdvantageOutputs(ret, ret)


@register_advantage_estimator("reinforce_pp", group_based=False, kl_placement="token")
def reinforce_pp(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    ret = discounted_returns(inputs.token_rewards, inputs.loss_mask, config.adv.discount)
    adv = normalize(ret, inputs.loss_mask, None, mean=True, std=True, eps=config.norm.eps,
                    all_reduce=inputs.all_reduce)
    return AdvantageOutputs(adv, ret)


def _group_outcome(inputs: AdvantageInputs, config: AlgorithmConfig, *, std: bool,
                   leave_one_out: bool, unbiased: bool = False) -> AdvantageOutputs:
    scores = normalize(inputs.seq_rewards, None, inputs.group_index, mean=True, std=std,
                       leave_one_out=leave_one_out, eps=config.norm.eps, unbiased=unbiased)
    return AdvantageOutputs(broadcast_to_tokens(scores, inputs.loss_mask, config.adv.discount))


@register_advantage_estimator("reinforce_baseline", group_based=True, kl_placement="token")
def reinforce_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    r = inputs.seq_rewards.to(torch.float64)
    group_mean = r - normalize(r, None, inputs.group_index, mean=True, std=False)
    # -mean_g r at each row's last trained token; the token KL (if any) stays in r_t
    centred = inputs.token_rewards - place_at_last_token(group_mean, inputs.loss_mask)
    ret = discounted_returns(centred, inputs.loss_mask, config.adv.discount)
    adv = normalize(ret, inputs.loss_mask, None, mean=True, std=True, eps=config.norm.eps,
                    all_reduce=inputs.all_reduce)
    return AdvantageOutputs(adv, ret)


@register_advantage_estimator("grpo", group_based=True, kl_placement="outcome")
def grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    return _group_outcome(inputs, config, std=True, leave_one_out=False,
                          unbiased=config.adv.group_std == "unbiased")


# LightRFT's name for GRPO's group normalisation
register_advantage_estimator("group_norm", group_based=True, kl_placement="outcome")(grpo)


@register_advantage_estimator("dr_grpo", group_based=True, kl_placement="outcome")
def dr_grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    return _group_outcome(inputs, config, std=False, leave_one_out=False)


@register_advantage_estimator("rloo", group_based=True, kl_placement="outcome")
def rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    return _group_outcome(inputs, config, std=False, leave_one_out=True)


@register_advantage_estimator("remax", group_based=False, kl_placement="outcome")
def remax(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    baseline = inputs.baseline_rewards
    discount = config.adv.discount
    if baseline is None:  # no greedy baseline: plain REINFORCE on the outcome
        return AdvantageOutputs(broadcast_to_tokens(inputs.seq_rewards, inputs.loss_mask,
                                                    discount))
    if baseline.shape != inputs.seq_rewards.shape:
        raise ValueError(f"'baseline_rewards' has shape {tuple(baseline.shape)}; expected "
                         f"{tuple(inputs.seq_rewards.shape)}")
    scores = inputs.seq_rewards - baseline.to(torch.float64)
    return AdvantageOutputs(broadcast_to_tokens(scores, inputs.loss_mask, discount))


@register_advantage_estimator("cpgd", group_based=True, kl_placement="outcome")
def cpgd(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutputs:
    centred = normalize(inputs.seq_rewards, None, inputs.group_index, mean=True, std=False,
                        eps=config.norm.eps)
    weights = clip_filter_weights(inputs.seq_rewards, inputs.group_index,
                                  config.filters.clip_filter_max_weight,
                                  config.filters.clip_filter_flat_weight,
                                  all_reduce=inputs.all_reduce)
    return AdvantageOutputs(broadcast_to_tokens(centred * weights, inputs.loss_mask,
                                                config.adv.discount))
