"""Actors of the preference stages: a reward model trained on pairs (Bradley-Terry), and a
policy trained on pairs directly (DPO). Batches are `data.preference.build_pair_batch`'s:
each pair two adjacent rows, chosen then rejected, kept in one micro-batch by the engine.

    rm = RewardModelActor(critic_engine, config.loss)     # ModelConfig.is_critic: scalar head
    rm.update(batch); rm.pair_scores(valid_batch)
    dpo = DPOActor(engine, config.loss)
    batch["ref_logp"] = DPOActor.response_logprobs(reference, batch)   # once per pair
    dpo.update(batch)
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from areal_like.algorithms.actors.base import default_tracker, require_keys
from areal_like.algorithms.actors.loss_fns import as_values
from areal_like.algorithms.functional import shift_to_next_token
from areal_like.algorithms.preference import (
    bradley_terry_loss,
    dpo_loss,
    last_token_values,
    pair_rows,
    response_logprobs,
)
from areal_like.api.engine_api import LossFn, TrainEngine
from areal_like.api.preference_config import DPOLossConfig, RewardModelLossConfig
from areal_like.utils.packed_logprobs import next_token_logprobs

PAIR_BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "loss_group_id", "is_chosen",
                   "margin")


def pairs_in(mb: TensorDict) -> float:
    """loss_weight_fn: a micro-batch's pairs (the losses are means over pairs)."""
    return float((mb["cu_seqlens"].numel() - 1) // 2)


def _pair_stats(tracker: Any, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    """Per-pair statistics of scores (a reward model's, or DPO's implicit rewards)."""
    ones = torch.ones_like(chosen, dtype=torch.bool)
    tracker.denominator(n_pairs=ones)
    tracker.stat(denominator="n_pairs", accuracy=(chosen > rejected).float(),
                 margin=chosen - rejected, chosen_reward=chosen, rejected_reward=rejected)


def _stacked(values: list[torch.Tensor]) -> torch.Tensor:
    """[B] per-row values; empty for a rank without rows (a small held-out set)."""
    return torch.stack(values) if values else torch.empty(0)


def _keep(batch: TensorDict, keys: tuple[str, ...], who: str) -> TensorDict:
    require_keys(batch, keys, who)
    return TensorDict({k: batch[k] for k in keys}, batch_size=batch.batch_size,
                      device=batch.device)


class RewardModelActor:
    """A scalar-head engine trained so that r(prompt + chosen) > r(prompt + rejected)."""

    def __init__(self, engine: TrainEngine, config: RewardModelLossConfig, tracker: Any = None,
                 scope: str = "rm") -> None:
        self.engine, self.config = engine, config
        self.tracker = default_tracker(tracker)
        self.scope = scope

    def loss_fn(self) -> LossFn:
        config, tracker = self.config, self.tracker

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            rewards = last_token_values(as_values(logits), mb["cu_seqlens"])
            c, r = pair_rows(mb)
            margin = mb["margin"][c].float() * config.margin_scale
            loss = bradley_terry_loss(rewards[c], rewards[r], margin).mean()
            _pair_stats(tracker, rewards[c].detach(), rewards[r].detach())
            return loss

        return loss_fn

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on the pairs' mean Bradley-Terry loss."""
        prepared = _keep(batch, PAIR_BATCH_KEYS, "RewardModelActor")
        with self.tracker.scope(self.scope), self.tracker.scope("train"):
            stats = self.engine.train_batch(prepared, loss_fn=self.loss_fn(),
                                            loss_weight_fn=pairs_in)
            self.tracker.scalar(**stats)
        return stats

    @torch.no_grad()
    def rewards(self, batch: TensorDict) -> torch.Tensor:
        """[B] each row's reward: the head's output at its last token."""
        self.engine.eval()
        return self.engine.forward(
            _keep(batch, ("input_ids", "attention_mask"), "RewardModelActor.rewards"),
            post_hook=lambda logits, mb: as_values(logits),
            aggregate_fn=lambda rows: _stacked([row[-1] for row in rows]))

    def pair_scores(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] chosen rewards, [P] rejected rewards) of the batch's pairs."""
        rewards = self.rewards(batch)
        return rewards[0::2], rewards[1::2]


class DPOActor:
    """A causal LM trained on pairs against a frozen reference's response log-probs."""

    def __init__(self, engine: TrainEngine, config: DPOLossConfig, tracker: Any = None,
                 scope: str = "dpo") -> None:
        self.engine, self.config = engine, config
        self.tracker = default_tracker(tracker)
        self.scope = scope

    @staticmethod
    def prepare(batch: TensorDict) -> TensorDict:
        """The pair keys, loss_mask in next-token alignment (it marks response + EOS)."""
        keys = PAIR_BATCH_KEYS + (("ref_logp",) if "ref_logp" in batch.keys() else ())
        prepared = _keep(batch, keys, "DPOActor")
        prepared["loss_mask"] = shift_to_next_token(batch["loss_mask"].bool())
        return prepared

    @staticmethod
    @torch.no_grad()
    def response_logprobs(engine: Any, batch: TensorDict) -> torch.Tensor:
        """[B] each row's response log-probability (sum over response + EOS) under `engine`
        (the policy, the reference, or a LoRA engine's frozen base view)."""
        engine.eval()
        prepared = DPOActor.prepare(batch)

        def masked_logp(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            logp = next_token_logprobs(logits, mb)
            return torch.where(mb["loss_mask"].bool(), logp, torch.zeros_like(logp))

        return engine.forward(prepared, post_hook=masked_logp,
                              aggregate_fn=lambda rows: _stacked([r.sum() for r in rows]))

    def loss_fn(self) -> LossFn:
        config, tracker = self.config, self.tracker

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            cu = mb["cu_seqlens"]
            logp_sum, n_tokens = response_logprobs(next_token_logprobs(logits, mb),
                                                   mb["loss_mask"], cu)
            ref_sum = mb["ref_logp"].float()
            c, r = pair_rows(mb)
            if config.loss_type == "ipo":  # per-token means (IPO's length normalisation)
                policy, ref = logp_sum / n_tokens.clamp(min=1), ref_sum / n_tokens.clamp(min=1)
            else:
                policy, ref = logp_sum, ref_sum
            loss = dpo_loss(policy[c], policy[r], ref[c], ref[r], config.beta, config.loss_type,
                            config.label_smoothing).mean()
            if config.sft_coef > 0:  # the chosen response's per-token NLL
                loss = loss + config.sft_coef * (-logp_sum[c] / n_tokens[c].clamp(min=1)).mean()
            implicit = config.beta * (logp_sum.detach() - ref_sum)
            _pair_stats(tracker, implicit[c], implicit[r])
            tracker.stat(denominator="n_pairs", chosen_logp=logp_sum.detach()[c],
                         rejected_logp=logp_sum.detach()[r])
            return loss

        return loss_fn

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on the pairs' mean DPO loss; `batch` carries `ref_logp`."""
        prepared = self.prepare(batch)
        require_keys(prepared, ("ref_logp",), "DPOActor.update (add the reference's "
                                              "response_logprobs as batch['ref_logp'])")
        self.engine.train()
        with self.tracker.scope(self.scope), self.tracker.scope("train"):
            stats = self.engine.train_batch(prepared, loss_fn=self.loss_fn(),
                                            loss_weight_fn=pairs_in)
            self.tracker.scalar(**stats)
        return stats

    def implicit_rewards(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] chosen, [P] rejected) implicit rewards beta (log pi - log ref) of the pairs."""
        require_keys(batch, ("ref_logp",), "DPOActor.implicit_rewards")
        implicit = self.config.beta * (self.response_logprobs(self.engine, batch)
                                       - batch["ref_logp"].float())
        return implicit[0::2], implicit[1::2]
