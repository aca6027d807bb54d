"""SFTActor: supervised fine-tuning (negative log-likelihood of the `loss_mask` tokens).

Batch keys (token alignment): input_ids, attention_mask, loss_mask (1 on tokens to learn,
e.g. the answer). The actor shifts loss_mask to next-token alignment (see `actors/base.py`).
"""

from __future__ import annotations

import functools
from typing import Any

from tensordict import TensorDict

from areal_like.algorithms.actors.base import default_tracker, require_keys
from areal_like.algorithms.actors.loss_fns import make_sft_loss_fn
from areal_like.algorithms.aggregation import loss_weight
from areal_like.algorithms.functional import shift_to_next_token
from areal_like.api.engine_api import TrainEngine
from areal_like.api.trajectory import model_inputs

SFT_KEYS = ("input_ids", "attention_mask", "loss_mask")


class SFTActor:
    def __init__(self, engine: TrainEngine, tracker: Any = None, scope: str = "sft") -> None:
        self.engine = engine
        self.tracker = default_tracker(tracker)
        self.scope = scope

    @staticmethod
    def prepare(batch: TensorDict) -> TensorDict:
        """Only the keys the loss needs, with loss_mask in next-token alignment."""
        require_keys(batch, SFT_KEYS, "SFTActor")
        return TensorDict({
            **model_inputs(batch),
            "loss_mask": shift_to_next_token(batch["loss_mask"].bool()),
        }, batch_size=batch.batch_size, device=batch.device)

    def _run(self, batch: TensorDict, train: bool) -> dict[str, float]:
        prepared = self.prepare(batch)
        weight_fn = functools.partial(loss_weight, mode="token-mean")
        loss_fn = make_sft_loss_fn(self.tracker)
        self.engine.train(train)
        with self.tracker.scope(self.scope), self.tracker.scope("train" if train else "eval"):
            run = self.engine.train_batch if train else self.engine.eval_batch
            stats = run(prepared, loss_fn=loss_fn, loss_weight_fn=weight_fn)
            self.tracker.scalar(**stats)
        return stats

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on the NLL of `batch`."""
        return self._run(batch, train=True)

    def evaluate(self, batch: TensorDict) -> dict[str, float]:
        """The same loss without a step."""
        return self._run(batch, train=False)
