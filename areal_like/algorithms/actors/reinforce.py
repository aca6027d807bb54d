"""ReinforceActor: the smallest complete algorithm, written as the two-class pattern that
"add your own algorithm" follows.

1. A backend-agnostic *actor* that knows the algorithm and nothing about the backend: it
   turns a batch into advantages and hands `loss_fn` / `loss_weight_fn` to any `TrainEngine`.
2. A *backend engine* class that knows the backend and nothing about the algorithm; a thin
   subclass wires the two together, e.g. with the FSDP2 engine:

       from engines.fsdp.engine import FSDPEngine

       class FSDPReinforceActor(FSDPEngine):
           def __init__(self, engine_config, algo_config):
               super().__init__(engine_config)
               self.actor = ReinforceActor(self, algo_config)

           def update(self, batch):
               return self.actor.update(batch)

The algorithm (REINFORCE with an optional per-sequence baseline, e.g. ReMax's greedy reward):

    A_i = shape(r_i) - shape(b_i)   (b_i = batch["baseline_rewards"][i], e.g. the greedy
                                     completion's raw reward; without it A_i = shape(r_i))
    shape(x) = clip((x + shaping.bias) * shaping.scaling, -shaping.clip, shaping.clip)
    loss = -(1 / #trained tokens) * sum_{i, t trained} A_i * log pi(y_{i,t+1} | y_{i,<=t})
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict

from areal_like.algorithms.actors.base import default_tracker, require_keys
from areal_like.algorithms.functional import masked_mean, shift_to_next_token
from areal_like.algorithms.rewards import shape_rewards
from areal_like.api.config import AlgorithmConfig
from areal_like.api.engine_api import TrainEngine
from areal_like.api.trajectory import model_inputs
from areal_like.utils.packed_logprobs import next_token_logprobs


def reinforce_loss_fn(logits: torch.Tensor, micro_batch: TensorDict,
                      temperature: float = 1.0) -> torch.Tensor:
    """Packed micro-batch -> token-mean of -A * log pi over the trained tokens."""
    logp = next_token_logprobs(logits, micro_batch, temperature)
    mask = micro_batch["loss_mask"].bool()
    return masked_mean(-micro_batch["advantages"].float() * logp, mask) + 0.0 * logits.sum()


def trained_tokens(micro_batch: TensorDict) -> torch.Tensor:
    """loss_weight_fn matching the token mean above."""
    return micro_batch["loss_mask"].bool().sum()


class ReinforceActor:
    def __init__(self, engine: TrainEngine, config: AlgorithmConfig, tracker: Any = None) -> None:
        self.engine, self.config = engine, config
        self.tracker = default_tracker(tracker)

    def compute_advantages(self, batch: TensorDict) -> TensorDict:
        require_keys(batch, ("input_ids", "attention_mask", "loss_mask", "rewards"),
                     "ReinforceActor")
        token_mask = batch["loss_mask"].bool()
        cfg = self.config
        shape = functools.partial(shape_rewards, scale=cfg.shaping.scaling, bias=cfg.shaping.bias,
                                  clip=cfg.shaping.clip)
        _, reward = shape(batch["rewards"], token_mask)
        advantages = reward
        if "baseline_rewards" in batch.keys():  # shaped exactly like the reward
            _, baseline = shape(batch["baseline_rewards"], token_mask)
            advantages = reward - baseline
        advantages = advantages.float()
        mask = shift_to_next_token(token_mask)  # position t now trains token t+1
        with self.tracker.scope("reinforce"):
            self.tracker.denominator(n_seqs=torch.ones_like(token_mask[:, 0]))
            self.tracker.stat(denominator="n_seqs", reward=reward.float(), advantage=advantages)
        return TensorDict({
            **model_inputs(batch),
            "loss_mask": mask,
            "advantages": advantages[:, None] * mask,  # one advantage for every token
        }, batch_size=batch.batch_size, device=batch.device)

    def update(self, batch: TensorDict) -> dict[str, float]:
        prepared = self.compute_advantages(batch)
        self.engine.train()
        temperature = self.config.temperature

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            return reinforce_loss_fn(logits, mb, temperature)

        return self.engine.train_batch(prepared, loss_fn=loss_fn, loss_weight_fn=trained_tokens)
