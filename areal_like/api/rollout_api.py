"""The contract a trainer drives rollout through: workflows run into batches on a fleet.

This class is the one declaration of the rollout API. `areal_like.rollout.controller.
RolloutController` implements it (an engine plus the workflow executor, in the caller's
process); `areal_like.rollout.process.RolloutProcess` is the same controller in a
process of its own, and both its trainer-side proxy and the controller process's dispatch are
derived from the abstract methods below (`remote_calls`): a method added here and to the
controller is callable across the process boundary with nothing else changed.
"""

from __future__ import annotations

import abc
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Protocol

from areal_like.api.engine_api import FleetClient, InferenceEngine

if TYPE_CHECKING:
    from tensordict import TensorDict

    from areal_like.api.workflow_api import RolloutWorkflow

class HeldOutEvaluation(Protocol):
    """Evaluation of one policy version (e.g. `areal_like.rollout.evaluation.Evaluator`)."""

    def draw_seeds(self, rollout: Any) -> list[list[int]]:
        """The episodes' seeds, drawn from `rollout.episode_seed` when evaluation starts."""

    async def arun(self, engine: InferenceEngine, seeds: list[list[int]]) -> dict[str, float]:
        """Run the episodes on `engine` (on the rollout loop); the metrics."""


# Lifecycle is local to each side (starting a process is not a call into it).
LOCAL_METHODS = frozenset({"initialize", "destroy"})

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

    @property
    @abc.abstractmethod
    def last_episode_ids(self) -> list[str]:
        """Episode ids (`data_id@episode_seed`) of the last batch returned."""

    @abc.abstractmethod
    def buffered_episode_ids(self) -> list[str]:
        """Episode ids of the accepted trajectories not yet handed out."""

    # ---- exact resume -------------------------------------------------------------------
    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to repeat this one: seeds drawn, buffered trajectories,
        the version."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any], restore_version: bool = True) -> None:
        ...

    # ---- statistics and held-out evaluation ---------------------------------------------
    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counts of the rollout queue and of episode outcomes so far."""

    @abc.abstractmethod
    def export_stats(self) -> dict[str, float]:
        """Rollout, reward and fleet statistics since the last export."""

    @abc.abstractmethod
    def start_evaluation(self, version: int) -> None:
        """Evaluate the fleet's current weights (labelled `version`) beside training; the
        next weight update waits for it. Results come from `finished_evaluations`."""

    @abc.abstractmethod
    def finished_evaluations(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(version, metrics) of the evaluations done since the last call; with `wait`, all
        started ones (bounded by the evaluation timeout). A failed evaluation raises."""


def remote_calls(api: type = RolloutAPI) -> dict[str, Callable[..., Any]]:
    """The methods of `api` a rollout controller answers across a process boundary: every
    public method it declares or inherits from `FleetClient`, but the local lifecycle
    (properties are state, not calls)."""
    calls = {}
    for cls in reversed(api.__mro__):
        if cls in (object, abc.ABC):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and name not in LOCAL_METHODS and inspect.isfunction(value):
                calls[name] = getattr(api, name)
    return calls
