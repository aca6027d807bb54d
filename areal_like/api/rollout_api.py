"""The contract a trainer drives rollout through: workflows run into batches on a fleet.

Implemented in-process by `areal_like.rollout.controller.RolloutController` (an engine plus the
workflow executor) and, for training, by `areal_like.runtime.rollout_process.RolloutProcess`
(the same controller in a process of its own).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from areal_like.api.engine_api import FleetClient

if TYPE_CHECKING:
    from tensordict import TensorDict

    from areal_like.api.workflow_api import RolloutWorkflow

# should_accept(trajectory) -> keep it? (e.g. drop groups whose rewards are all equal)
ShouldAccept = Callable[["TensorDict"], bool]


class RolloutAPI(FleetClient):
    """Runs workflows asynchronously with staleness control and hands out finished batches."""

    @abc.abstractmethod
    def submit(self, data: dict[str, Any], workflow: RolloutWorkflow,
               should_accept: Optional[ShouldAccept] = None) -> None:
        """Queue one data item to be turned into a trajectory by `workflow`; a trajectory for
        which `should_accept` returns False is rejected (e.g. dynamic sampling)."""

    @abc.abstractmethod
    def wait(self, count: int, timeout: Optional[float] = None) -> TensorDict:
        """Block until `count` accepted trajectories exist; return them concatenated."""

    @abc.abstractmethod
    def rollout_batch(self, data: list[dict[str, Any]], workflow: RolloutWorkflow,
                      should_accept: Optional[ShouldAccept] = None,
                      timeout: Optional[float] = None) -> TensorDict:
        """Submit every item of `data` and wait for all of them (synchronous rollout)."""

    @abc.abstractmethod
    def prepare_batch(self, dataloader: Iterable[Any], workflow: RolloutWorkflow,
                      should_accept: Optional[ShouldAccept] = None,
                      timeout: Optional[float] = None) -> TensorDict:
        """Keep the pipeline full from `dataloader` and return the next consumer batch."""
