"""CriticActor: a value model trained with the clipped value loss, for PPO with GAE.

    batch["values"] = critic.compute_values(batch)     # V(s_t), next-token aligned
    prepared = actor.compute_advantages(batch)         # adv.estimator="gae": adds returns
    actor.update(prepared)
    critic.update(prepared)

The critic engine's model has a scalar head (`ModelConfig.is_critic`): its output is one
value per packed token ([T], or [T, 1] before squeezing), the value of the state after each
token, i.e. the state in which token t+1 is chosen; this is already next-token alignment
(see `actors/base.py`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict

from areal_like.algorithms.actors.base import (
    default_tracker,
    require_keys,
    train_minibatches,
)
from areal_like.algorithms.actors.loss_fns import as_values, make_value_loss_fn
from areal_like.algorithms.aggregation import loss_weight
from areal_like.api.config import AlgorithmConfig
from areal_like.api.engine_api import TrainEngine


def value_post_hook(logits: torch.Tensor, micro_batch: TensorDict) -> torch.Tensor:
    """engine.forward post_hook: critic output -> [T] values."""
    return as_values(logits)


class CriticActor:
    def __init__(self, engine: TrainEngine, config: AlgorithmConfig, tracker: Any = None,
                 scope: str = "critic") -> None:
        self.engine, self.config = engine, config
        self.tracker = default_tracker(tracker)
        self.scope = scope

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """[B, L] values V(s_t) of every position (next-token aligned)."""
        self.engine.eval()
        out = self.engine.forward(batch, post_hook=value_post_hook)
        if tuple(out.shape) != tuple(batch["input_ids"].shape):
            raise RuntimeError(f"critic forward returned shape {tuple(out.shape)}; expected "
                               f"{tuple(batch['input_ids'].shape)}")
        return out.float()

    def update(self, prepared: TensorDict) -> dict[str, float]:
        """Value-regression step(s) on a batch prepared by `PPOActor.compute_advantages`."""
        require_keys(prepared, ("advantages", "returns", "values", "loss_mask"),
                     "CriticActor.update (pass the batch returned by compute_advantages)")
        loss_fn = make_value_loss_fn(self.config, self.tracker)
        weight_fn = functools.partial(loss_weight, mode="token-mean")
        return train_minibatches(self.engine, prepared, self.config.update.n_minibatches, loss_fn,
                                 weight_fn, self.tracker, self.scope,
                                 n_epochs=self.config.update.epochs)
