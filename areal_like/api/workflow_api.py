"""The contract a rollout workflow implements."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from tensordict import TensorDict

    from areal_like.api.engine_api import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """Turns one data item into a trajectory by talking to an `InferenceEngine`.

    `arun_episode` runs as a coroutine next to many others; it must not block the event loop
    (run CPU-heavy work in an executor). Return a TensorDict trajectory with batch size [B]
    holding at least `input_ids`, `attention_mask`, `loss_mask`, `logprobs`, `versions`
    ([B, L], `versions == -1` on tokens the policy did not generate) and `rewards` ([B]); see
    `areal_like.api.validate_trajectory`. Return None to reject the item.

    `metric_keys` names per-sequence keys of the trajectory that measure the task (e.g. an
    agent's tool-call success); recipes log their episode means in training and evaluation.
    A per-sequence `accuracy` key, when present, is what `eval/accuracy` reports.
    `needs_images`: the workflow sends the items' images (a run checks for a vision tower).
    """

    metric_keys: tuple[str, ...] = ()
    needs_images: bool = False

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> Optional[TensorDict]:
        ...
