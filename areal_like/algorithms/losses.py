"""Per-token policy losses (to be minimised) and the clipped value loss, on packed [T] tensors.

Notation: lp = log pi_theta(y_t) (trained), lp_old = the ratio's anchor (the proximal policy's
recomputed log-prob in decoupled PPO, otherwise the old/behaviour log-prob), A = advantage,
r = exp(lp - lp_old), eps_l = eps_clip, eps_h = eps_clip_high (default eps_l).

    ppo        l = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h));
               dual clip (c > 1): for A < 0, l = min(l, -c A)
    decoupled  l = w * l_ppo(r = pi_theta / pi_prox),  w = pi_prox / pi_behav (constant);
               tokens with w > behav_imp_weight_cap get w = 0 (and are counted)
    gspo       l = l_ppo with r replaced by the sequence ratio
               s_i = exp(mean_{t in i} (lp_t - lp_old_t)), shared by every token of sequence i
    cispo      l = -sg(clip(r, 1 - eps_l, 1 + eps_h)) * A * lp    (sg: stop-gradient)
    reinforce  l = -A * lp
    cpgd       l = max(-A log r, -A clip(log r, log(1 - eps_l), log(1 + eps_h)))
                   + cpgd_drift_coef * (r - 1 - log r)      [policy drift KL(pi_old || pi)]
    value      l = 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -eps_v, eps_v) - R)^2)

Every per-token input is zeroed at masked-out positions before any arithmetic
(`masked_inputs`), so NaN/inf there never reach a loss or a gradient; log-ratios are clamped
to [-20, 20] before exponentiation so extreme ratios stay finite. Every function returns 0 on
masked-out tokens; aggregation over tokens is `aggregation.py`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from areal_like.algorithms.functional import segment_ids, segment_mean
from areal_like.algorithms.registry import register_policy_loss

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig

LOG_RATIO_LIMIT = 20.0
LossStats = dict[str, torch.Tensor]


@dataclass
class PolicyLossInputs:
    """Packed per-token inputs of a policy loss (one micro-batch)."""

    logprobs: torch.Tensor  # [T] trained policy, differentiable
    old_logprobs: torch.Tensor  # [T] the ratio's anchor (constant)
    advantages: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [n_seqs + 1] sequence boundaries of the packed tokens


def masked_inputs(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with 0 at masked-out positions, selected *before* any arithmetic: a `where`
    after exp/log/mul would still send NaN into the gradient (0 * inf = NaN)."""
    m = mask.bool()
    return tuple(torch.where(m, t, torch.zeros((), dtype=t.dtype, device=t.device))
                 for t in tensors)


def _masked_log_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    diff = torch.where(mask, logp - old.detach(), torch.zeros_like(logp))
    return diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                      eps_low: float, eps_high: float,
                      c_clip: Optional[float] = None) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate (with optional dual clip) for a given ratio tensor."""
    adv = adv.detach().to(ratio.dtype)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    stats: LossStats = {"clip_mask": (loss2 > loss1).detach() & mask}
    if c_clip is not None:
        loss3 = -adv * c_clip
        dual = (adv < 0) & (loss > loss3)
        loss = torch.where(dual, loss3, loss)
        stats["dual_clip_mask"] = dual.detach() & mask
    return torch.where(mask, loss, torch.zeros_like(loss)), stats


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, eps_low: float = 0.2, eps_high: Optional[float] = None,
             c_clip: Optional[float] = None) -> tuple[torch.Tensor, LossStats]:
    """Clipped PPO per-token loss (clip-higher via eps_high, dual clip via c_clip)."""
    m = mask.bool()
    logprobs, old_logprobs, advantages = masked_inputs(m, logprobs, old_logprobs, advantages)
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs, m))
    loss, stats = clipped_surrogate(ratio, advantages, m, eps_low,
                                    eps_low if eps_high is None else eps_high, c_clip)
    stats["importance_weight"] = ratio.detach()
    return loss, stats


def behaviour_importance_weights(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                                 mask: torch.Tensor,
                                 cap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w = pi_prox / pi_behav with capped tokens set to 0, kept-token mask), both [T]."""
    m = mask.bool()
    prox_logprobs, behav_logprobs = masked_inputs(m, prox_logprobs, behav_logprobs)
    w = torch.exp(_masked_log_ratio(prox_logprobs.detach(), behav_logprobs, m))
    kept = m if cap is None else m & (w <= cap)
    return torch.where(kept, w, torch.zeros_like(w)), kept


def decoupled_ppo_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor,
                       behav_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, eps_low: float = 0.2,
                       eps_high: Optional[float] = None, c_clip: Optional[float] = None,
                       behav_imp_weight_cap: Optional[float] = None,
                       ) -> tuple[torch.Tensor, LossStats]:
    """Decoupled PPO for asynchronous data: PPO against the proximal policy, re-weighted by
    the (capped) importance weight proximal / behaviour. Equals `ppo_loss` when proximal ==
    behaviour."""
    loss, stats = ppo_loss(logprobs, prox_logprobs, advantages, mask, eps_low, eps_high, c_clip)
    w, kept = behaviour_importance_weights(prox_logprobs, behav_logprobs, mask,
                                           behav_imp_weight_cap)
    stats.update(behav_imp_weight=w, behav_kept_mask=kept)
    return loss * w.to(loss.dtype), stats


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cu_seqlens: torch.Tensor, eps_low: float = 3e-4,
              eps_high: Optional[float] = None) -> tuple[torch.Tensor, LossStats]:
    """GSPO: the clipped surrogate with the per-sequence length-normalised ratio."""
    m = mask.bool()
    logprobs, old_logprobs, advantages = masked_inputs(m, logprobs, old_logprobs, advantages)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, m)
    seq_log_ratio, _ = segment_mean(log_ratio, m, cu_seqlens)
    ids = segment_ids(cu_seqlens, logprobs.shape[0])
    seq_ratio = torch.exp(torch.cat([seq_log_ratio, seq_log_ratio.new_zeros(1)]))
    ratio = seq_ratio[ids]
    loss, stats = clipped_surrogate(ratio, advantages, m, eps_low,
                                    eps_low if eps_high is None else eps_high)
    stats["importance_weight"] = ratio.detach()
    return loss, stats


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, eps_low: float = 0.2,
               eps_high: Optional[float] = None) -> tuple[torch.Tensor, LossStats]:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio."""
    m = mask.bool()
    logprobs, old_logprobs, advantages = masked_inputs(m, logprobs, old_logprobs, advantages)
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs, m)).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -weight * advantages.detach().to(logprobs.dtype) * logprobs
    stats: LossStats = {"importance_weight": ratio, "clip_mask": (weight != ratio) & m}
    return torch.where(m, loss, torch.zeros_like(loss)), stats


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, LossStats]:
    """REINFORCE: -A * log pi (no ratio; on-policy)."""
    m = mask.bool()
    logprobs, advantages = masked_inputs(m, logprobs, advantages)
    loss = -advantages.detach().to(logprobs.dtype) * logprobs
    return torch.where(m, loss, torch.zeros_like(loss)), {}


def cpgd_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, eps_low: float = 0.2, eps_high: Optional[float] = None,
              drift_coef: float = 0.0) -> tuple[torch.Tensor, LossStats]:
    """CPGD: policy gradient on the clipped log-ratio plus a policy-drift KL penalty."""
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"cpgd_loss needs eps_clip in (0, 1) for log(1 - eps), got {eps_low}")
    m = mask.bool()
    logprobs, old_logprobs, advantages = masked_inputs(m, logprobs, old_logprobs, advantages)
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, m)
    loss1 = -adv * log_ratio
    loss2 = -adv * log_ratio.clamp(math.log(1.0 - eps_low), math.log(1.0 + eps_high))
    loss = torch.maximum(loss1, loss2)
    ratio = torch.exp(log_ratio)
    if drift_coef:
        loss = loss + drift_coef * (ratio - 1.0 - log_ratio)
    stats: LossStats = {"importance_weight": ratio.detach(),
                        "clip_mask": (loss2 > loss1).detach() & m}
    return torch.where(m, loss, torch.zeros_like(loss)), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, eps_clip: Optional[float] = 0.2,
               ) -> tuple[torch.Tensor, LossStats]:
    """Clipped value loss per token (eps_clip None: plain 0.5 * (v - R)^2)."""
    m = mask.bool()
    values, old_values, returns = masked_inputs(m, values, old_values, returns)
    ret = returns.detach().to(values.dtype)
    err = (values - ret).square()
    if eps_clip is None:
        loss, clip_mask = 0.5 * err, torch.zeros_like(m)
    else:
        old = old_values.detach().to(values.dtype)
        clipped = old + (values - old).clamp(-eps_clip, eps_clip)
        err_clipped = (clipped - ret).square()
        loss = 0.5 * torch.maximum(err, err_clipped)
        clip_mask = (err_clipped > err).detach() & m
    return torch.where(m, loss, torch.zeros_like(loss)), {"value_clip_mask": clip_mask}


# ---- registered by name: fn(PolicyLossInputs, AlgorithmConfig) -> (token_loss, stats) -------

def _eps(config: AlgorithmConfig) -> tuple[float, float]:
    high = config.loss.eps_clip if config.loss.eps_clip_high is None else config.loss.eps_clip_high
    return config.loss.eps_clip, high


@register_policy_loss("ppo")
def _ppo(x: PolicyLossInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, LossStats]:
    low, high = _eps(config)
    return ppo_loss(x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, low, high,
                    config.loss.c_clip)


@register_policy_loss("gspo")
def _gspo(x: PolicyLossInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, LossStats]:
    low, high = _eps(config)
    return gspo_loss(x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, x.cu_seqlens,
                     low, high)


@register_policy_loss("cispo")
def _cispo(x: PolicyLossInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, LossStats]:
    low, high = _eps(config)
    return cispo_loss(x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, low, high)


@register_policy_loss("reinforce")
def _reinforce(x: PolicyLossInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, LossStats]:
    return reinforce_loss(x.logprobs, x.advantages, x.loss_mask)


@register_policy_loss("cpgd")
def _cpgd(x: PolicyLossInputs, config: AlgorithmConfig) -> tuple[torch.Tensor, LossStats]:
    low, high = _eps(config)
    return cpgd_loss(x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, low, high,
                     config.loss.cpgd_drift_coef)
