"""Errors raised to the caller of rollout: by the executor, and by an engine without a fleet."""

from __future__ import annotations

from typing import Any, Optional


class RolloutError(RuntimeError):
    """Base class of the executor's errors."""


class RolloutWorkflowError(RolloutError):
    """A workflow raised (or produced an invalid trajectory) for one data item.

    The original exception, with its traceback from inside the workflow, is `__cause__`.
    """

    def __init__(self, message: str, data_id: str, seq: int, data: Optional[dict[str, Any]]):
        super().__init__(message)
        self.data_id = data_id
        self.seq = seq
        self.data = data


class RolloutTimeoutError(RolloutError, TimeoutError):
    """`wait` / `prepare_batch` / `rollout_batch` ran out of time; the message has the counts."""


class NoTrajectoriesError(RolloutError):
    """`rollout_batch` finished but every item was rejected or dropped."""


class RolloutQueueFullError(RolloutError):
    """`submit` found the input queue at `rollout.staleness.queue_size`."""


class ExecutorClosedError(RolloutError):
    """The executor was used before `initialize()` or after `destroy()`."""


class FleetUnavailableError(RolloutError):
    """Too few inference servers are in service; the message names each one out and why."""


class RequestRejected(RuntimeError):
    """An inference server refused a request itself (HTTP 4xx: past the context, an invalid
    field): any server would, so it is not retried, and it is the caller's error, not the
    fleet's. Raised by the fleet client as `engines.server.errors.RequestRejectedError`."""
