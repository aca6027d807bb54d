"""The `loss_fn(logits, micro_batch)` closures actors hand to `TrainEngine.train_batch`.

They run on the engine's packed micro-batch: `logits` [T, V], and every per-token key of the
prepared batch packed to [T] (next-token aligned, see `actors/base.py`) plus `cu_seqlens`.
Keys read by the policy loss: input_ids, loss_mask, advantages, old_logp (the ratio's
anchor), and when configured logprobs (behaviour) + prox_logp (decoupled loss), ref_logp
(KL in the loss). Without old_logp / prox_logp (the batch is trained in one optimizer step,
see `PPOActor.proximal_from_update`) this forward's detached log-probs are the proximal
policy's: the weights are the same, and the train/inference gap is recorded here, under the
actor's scope (`<scope>/gap/`, with `version_lag` when the batch has it).

Policy objective per token (then aggregated by `loss.agg_mode`):

    l_t = w_t * l_policy(t) - loss.entropy_coef * H_t + kl.coef * KL_t(pi || pi_ref)

with w_t the decoupled behaviour importance weight (1 when the decoupled loss is off; capped
and corrected by `off_policy.correction`, see `corrections.py`), the KL
term only when kl.in_reward is False. With loss.top_entropy_ratio < 1 the prepared batch's
`policy_mask` (the whole batch's highest-entropy tokens, chosen by PPOActor when the batch was
prepared) replaces loss_mask in the loss and in the aggregation's denominators. Every input is
zeroed at masked-out positions before use, so NaN/inf there reach neither loss nor gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from tensordict import TensorDict

from areal_like.algorithms.aggregation import aggregate_loss
from areal_like.algorithms.corrections import corrected_weights
from areal_like.algorithms.kl import kl_estimate, kl_full
from areal_like.algorithms.losses import (
    PolicyLossInputs,
    masked_inputs,
    value_loss,
)
from areal_like.algorithms.mismatch import record_gap_packed
from areal_like.algorithms.registry import get_policy_loss
from areal_like.utils.packed_logprobs import next_token_logprobs, next_token_logprobs_entropy

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig

LossFn = Callable[[torch.Tensor, TensorDict], torch.Tensor]


def _zero_if_empty(loss: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # keep the graph connected to every parameter even without trained tokens (FSDP needs
    # every rank to run the same backward)
    return loss if bool(mask.any()) else loss + 0.0 * logits.sum()


def make_policy_loss_fn(config: AlgorithmConfig, tracker: Any,
                        kl_coef: Optional[float] = None,
                        proximal_from_forward: bool = False) -> LossFn:
    """The PPO-family loss closure for `config` (policy loss looked up by name); `kl_coef`
    is the KL controller's current coefficient (None: config.kl.coef).
    `proximal_from_forward`: the batch is trained in this one optimizer step, so a batch
    without prox_logp / old_logp takes this forward's (see the module doc)."""
    policy_loss = get_policy_loss(config.loss.policy)
    coef = config.kl.coef if kl_coef is None else kl_coef

    def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        logp, entropy = next_token_logprobs_entropy(logits, mb, config.temperature)
        trained = mb["loss_mask"].bool()
        # the high-entropy selection was made once for the whole batch (PPOActor)
        mask = mb["policy_mask"].bool() if "policy_mask" in mb.keys() else trained
        logp, entropy = masked_inputs(trained, logp, entropy)
        # no proximal log-probs in the batch: this forward's weights are the proximal policy
        prox_here = proximal_from_forward and "prox_logp" not in mb.keys()
        current = logp.detach()
        (old,) = masked_inputs(mask, current if prox_here and "old_logp" not in mb.keys()
                               else mb["old_logp"].float())
        if config.off_policy.decoupled:
            prox, behav = masked_inputs(mask, current if prox_here else mb["prox_logp"].float(),
                                        mb["logprobs"].float())
        inputs = PolicyLossInputs(logp, old, mb["advantages"].float(), mask, mb["cu_seqlens"])
        token_loss, st = policy_loss(inputs, config)
        kept = mask
        if config.off_policy.decoupled:  # the behaviour weight, capped and corrected
            w, kept = corrected_weights(prox, behav, mask, mb["cu_seqlens"], config.off_policy)
            token_loss = token_loss * w
        if config.loss.entropy_coef:
            token_loss = token_loss - config.loss.entropy_coef * entropy
        kl = None
        if config.kl.coef and not config.kl.in_reward:
            if config.kl.estimator == "full":
                kl = _full_kl(logits, mb, mask, config.temperature)
            else:
                (ref,) = masked_inputs(mask, mb["ref_logp"].float())
                kl = kl_estimate(logp, ref, config.kl.estimator)
            token_loss = token_loss + coef * kl
        token_loss = torch.where(mask, token_loss, torch.zeros_like(token_loss))
        loss = aggregate_loss(token_loss, mask, mb["cu_seqlens"], config.loss.agg_mode,
                              config.loss.agg_constant)

        tracker.denominator(n_valid_tokens=mask, n_trained_tokens=trained)
        log_ratio = torch.where(mask, logp.detach() - old, 0.0)
        values = {
            "importance_weight": st.get("importance_weight", torch.exp(log_ratio)),
            "approx_kl": log_ratio,
            "clip_ratio": st.get("clip_mask", torch.zeros_like(mask)).float(),
            "new_logp": logp.detach(),
            "pg_loss": token_loss.detach(),
        }
        if "dual_clip_mask" in st:
            values["dual_clip_ratio"] = st["dual_clip_mask"].float()
        if kl is not None:
            values["kl_ref"] = kl.detach()
        tracker.stat(denominator="n_valid_tokens", **values)
        tracker.stat(denominator="n_trained_tokens", entropy=entropy.detach())
        if config.off_policy.decoupled:
            behav_log_w = prox - behav
            tracker.denominator(n_behav_kept_tokens=kept)
            tracker.stat(denominator="n_valid_tokens", behav_approx_kl=behav_log_w,
                         behav_capped_ratio=(mask & ~kept).float())
            tracker.stat(denominator="n_behav_kept_tokens", behav_imp_weight=w)
        if prox_here and "logprobs" in mb.keys():
            with tracker.outside("update"):  # a statistic of the batch, not of this step
                record_gap_packed(tracker, mb["logprobs"].float(), current, trained,
                                  mb["cu_seqlens"], mb.get("version_lag", None), config.off_policy)
        return _zero_if_empty(loss, logits, mask)

    return loss_fn


def _full_kl(logits: torch.Tensor, mb: TensorDict, mask: torch.Tensor,
             temperature: float) -> torch.Tensor:
    """kl.estimator=full: the exact per-position KL to the reference's top-k distribution."""
    missing = [k for k in ("ref_top_ids", "ref_top_logp") if k not in mb.keys()]
    if missing:
        raise KeyError(f"algorithm.kl.estimator=full needs the reference's top-k next-token "
                       f"log-probs in the batch; missing {missing} (the distill recipe brings "
                       f"them with teacher.top_k > 0)")
    keep = mask[:, None]
    ids = torch.where(keep, mb["ref_top_ids"].long(), 0)
    top = torch.where(keep, mb["ref_top_logp"].float(), 0.0)  # NaN/inf masked out before use
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.where(mask, kl_full(logp_all, ids, top), 0.0)


def as_values(logits: torch.Tensor) -> torch.Tensor:
    """Critic output [T] or [T, 1] -> [T] float values."""
    if logits.dim() == 2 and logits.shape[-1] == 1:
        logits = logits[:, 0]
    if logits.dim() != 1:
        raise ValueError(f"critic output has shape {tuple(logits.shape)}; expected [T] or "
                         "[T, 1] (a scalar value head: ModelConfig.is_critic=True)")
    return logits.float()


def make_value_loss_fn(config: AlgorithmConfig, tracker: Any) -> LossFn:
    """Clipped value loss (token-mean) for a critic engine whose output is [T] (or [T, 1])."""

    def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        values = as_values(logits)
        mask = mb["loss_mask"].bool()
        token_loss, st = value_loss(values, mb["values"].float(), mb["returns"].float(), mask,
                                    config.loss.value_eps_clip)
        loss = aggregate_loss(token_loss, mask, mb["cu_seqlens"], "token-mean")
        tracker.denominator(n_valid_tokens=mask)
        tracker.stat(denominator="n_valid_tokens", value_loss=token_loss.detach(),
                     value_clip_ratio=st["value_clip_mask"].float(), new_values=values.detach())
        return _zero_if_empty(loss, logits, mask)

    return loss_fn


def make_sft_loss_fn(tracker: Any, temperature: float = 1.0) -> LossFn:
    """Negative log-likelihood of the trained tokens (token-mean)."""

    def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        logp = next_token_logprobs(logits, mb, temperature)
        mask = mb["loss_mask"].bool()
        loss = aggregate_loss(-logp, mask, mb["cu_seqlens"], "token-mean")
        tracker.denominator(n_valid_tokens=mask)
        tracker.stat(denominator="n_valid_tokens", nll=-logp.detach())
        return _zero_if_empty(loss, logits, mask)

    return loss_fn
