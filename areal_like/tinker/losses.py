"""The Tinker API's built-in losses on a packed micro-batch.

Tinker's convention: position t of a datum predicts `target_tokens[t]` (the client shifts),
and a loss is a plain **sum** over tokens and datums (no normalisation). With lp_t the trained
model's log-probability of target_tokens[t] and q_t the sampler's (`logprobs` input):

- cross_entropy:        -w_t lp_t                            (target_tokens, weights)
- importance_sampling:  -exp(lp_t - q_t) A_t                 (target_tokens, logprobs,
                                                               advantages)
- ppo:                  -min(r_t A_t, clip(r_t, lo, hi) A_t)  (the same; r = exp(lp - q),
                        config clip_low_threshold = lo (0.8), clip_high_threshold = hi (1.2))
- cispo:                -sg(clip(r_t, lo, hi)) lp_t A_t      (the same; sg: no gradient)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict

from areal_like.tinker.errors import UserError

# the packed micro-batch's keys the losses read (the batch builder's names for Tinker's inputs)
TARGETS, WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES = ("target_tokens", "loss_weights",
                                                  "sampler_logprobs", "advantages")
# Tinker's input name -> our batch key
INPUT_KEYS = {"target_tokens": TARGETS, "weights": WEIGHTS, "logprobs": SAMPLER_LOGPROBS,
              "advantages": ADVANTAGES}
_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@dataclass(frozen=True)
class LossSpec:
    inputs: tuple[str, ...]  # Tinker's input names it needs (besides target_tokens)
    config: dict[str, float]  # the config keys it takes, with their defaults


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("weights",), {}),
    "importance_sampling": LossSpec(("logprobs", "advantages"), {}),
    "ppo": LossSpec(("logprobs", "advantages"), _CLIP_DEFAULTS),
    "cispo": LossSpec(("logprobs", "advantages"), _CLIP_DEFAULTS),
}


def check_loss(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """The loss's config with defaults filled; UserError for an unknown loss or key."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise UserError(f"loss_fn {loss_fn!r} is not supported by this server; supported: "
                        f"{sorted(LOSSES)} (docs/tinker.md)")
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        raise UserError(f"loss_fn_config keys {unknown} are not taken by {loss_fn!r} "
                        f"(it takes {sorted(spec.config) or 'none'})")
    values = {**spec.config}
    for key, value in config.items():
        if not isinstance(value, float):
            raise UserError(f"loss_fn_config[{key!r}]={value!r}: expected a number")
        values[key] = value
    if "clip_low_threshold" in values and not (
            0 < values["clip_low_threshold"] <= 1 <= values["clip_high_threshold"]):
        raise UserError(f"loss_fn_config clip thresholds {values}: need 0 < "
                        f"clip_low_threshold <= 1 <= clip_high_threshold")
    return values


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t]) under logits[t] (no shift: Tinker's inputs come aligned)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def elementwise_loss(loss_fn: str, config: dict[str, float], lp: torch.Tensor,
                     mb: TensorDict) -> torch.Tensor:
    """The per-token loss [T] of `loss_fn` given the trained log-probs `lp` [T]."""
    if loss_fn == "cross_entropy":
        return -mb[WEIGHTS].to(lp.dtype) * lp
    q = mb[SAMPLER_LOGPROBS].to(lp.dtype)
    advantages = mb[ADVANTAGES].to(lp.dtype)
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages)
    if loss_fn == "cispo":
        return -clipped.detach() * lp * advantages
    raise UserError(f"loss_fn {loss_fn!r} is not supported")


def packed_loss(loss_fn: str, config: dict[str, float]
                ) -> Callable[[torch.Tensor, TensorDict], torch.Tensor]:
    """The engine's loss_fn: the micro-batch's summed loss."""
    def loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        return elementwise_loss(loss_fn, config, target_logprobs(logits, mb[TARGETS]), mb).sum()
    return loss


def packed_outputs(loss_fn: str, config: dict[str, float]
                   ) -> Callable[[torch.Tensor, TensorDict], torch.Tensor]:
    """The engine's outputs hook: per token [T, 2] = (log-prob of the target, its loss)."""
    def outputs(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        lp = target_logprobs(logits, mb[TARGETS])
        return torch.stack([lp, elementwise_loss(loss_fn, config, lp, mb)], dim=-1)
    return outputs
