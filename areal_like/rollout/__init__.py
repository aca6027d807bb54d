"""Rollout runtime: the WorkflowExecutor, staleness control and trajectory batching."""

from areal_like.api.errors import (
    ExecutorClosedError,
    FleetUnavailableError,
    NoTrajectoriesError,
    RolloutError,
    RolloutQueueFullError,
    RolloutTimeoutError,
    RolloutWorkflowError,
)
from areal_like.rollout.data_cursor import DataCursor
from areal_like.rollout.executor import WorkflowExecutor
from areal_like.rollout.staleness import admission_capacity, is_stale, staleness_bound
from areal_like.utils.batching import concat_padded, min_generated_version

__all__ = [
    "DataCursor",
    "ExecutorClosedError",
    "FleetUnavailableError",
    "NoTrajectoriesError",
    "RolloutError",
    "RolloutQueueFullError",
    "RolloutTimeoutError",
    "RolloutWorkflowError",
    "WorkflowExecutor",
    "admission_capacity",
    "concat_padded",
    "is_stale",
    "min_generated_version",
    "staleness_bound",
]
