"""The contracts users program against, importable flat from `areal_like.api`.

The names load on first use (PEP 562): a process that only reads configs
(`areal_like.api.config`, e.g. the launcher) does not import torch and tensordict for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_like.lazy import LazyExports

if TYPE_CHECKING:
    from areal_like.api.engine_api import (
        FleetClient,
        InferenceEngine,
        LossFn,
        LossWeightFn,
        TrainEngine,
    )
    from areal_like.api.io_struct import (
        FinetuneSpec,
        GenerationHyperparameters,
        ModelRequest,
        ModelResponse,
        SaveLoadMeta,
        WeightUpdateMeta,
    )
    from areal_like.api.rollout_api import RolloutAPI, ShouldAccept
    from areal_like.api.trajectory import TrajectoryError, validate_trajectory
    from areal_like.api.workflow_api import RolloutWorkflow

_LAZY = LazyExports(__name__, {k: f"areal_like.api.{m}" for k, m in {
    **dict.fromkeys(["FleetClient", "InferenceEngine", "LossFn", "LossWeightFn", "TrainEngine"],
                    "engine_api"),
    **dict.fromkeys(["FinetuneSpec", "GenerationHyperparameters", "ModelRequest",
                     "ModelResponse", "SaveLoadMeta", "WeightUpdateMeta"], "io_struct"),
    **dict.fromkeys(["RolloutAPI", "ShouldAccept"], "rollout_api"),
    **dict.fromkeys(["TrajectoryError", "validate_trajectory"], "trajectory"),
    "RolloutWorkflow": "workflow_api",
}.items()})

__all__ = [
    "FinetuneSpec",
    "FleetClient",
    "GenerationHyperparameters",
    "InferenceEngine",
    "LossFn",
    "LossWeightFn",
    "ModelRequest",
    "ModelResponse",
    "RolloutAPI",
    "RolloutWorkflow",
    "SaveLoadMeta",
    "ShouldAccept",
    "TrainEngine",
    "TrajectoryError",
    "WeightUpdateMeta",
    "validate_trajectory",
]
assert sorted(__all__) == sorted(_LAZY.names)


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.dir()
