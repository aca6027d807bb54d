"""The contracts users program against, importable flat from `areal_like.api`."""

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
