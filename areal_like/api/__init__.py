"""The contracts users program against, importable flat from `areal_like.api`."""

from areal_like.api.engine_api import InferenceEngine, LossFn, LossWeightFn, TrainEngine
from areal_like.api.io_struct import (
    GenerationHyperparameters,
    ModelRequest,
    ModelResponse,
    SaveLoadMeta,
    WeightUpdateMeta,
)
from areal_like.api.trajectory import TrajectoryError, validate_trajectory
from areal_like.api.workflow_api import RolloutWorkflow

__all__ = [
    "GenerationHyperparameters",
    "InferenceEngine",
    "LossFn",
    "LossWeightFn",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "SaveLoadMeta",
    "TrainEngine",
    "TrajectoryError",
    "WeightUpdateMeta",
    "validate_trajectory",
]
