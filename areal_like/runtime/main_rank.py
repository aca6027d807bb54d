"""Phases only rank 0 works in (waiting for rollouts, held-out evaluation, loading weights on
the fleet), made safe for the other trainer ranks.

The other ranks wait in a collective, and every collective is bounded by
`actor.collective_timeout`. A phase longer than that would kill them, so rank 0 runs the
phase in a thread and broadcasts a heartbeat well inside the timeout; the others stay in step
with it. When the phase fails on rank 0, the failure is broadcast too: every rank raises the
same `MainRankError`, within one heartbeat, instead of rank 0 failing alone and the others
timing out much later with an unrelated error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import traceback
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

logger = logging.getLogger("areal_like")

T = TypeVar("T")

RUNNING, DONE, FAILED = "running", "done", "failed"


class MainRankError(RuntimeError):
    """A phase that only rank 0 runs failed there; raised alike on every rank."""


def heartbeat_interval(collective_timeout_s: float) -> float:
    """A fifth of the collective timeout (a late heartbeat still arrives in time), at most
    5 s so a failure reaches the other ranks promptly."""
    return max(0.05, min(5.0, collective_timeout_s / 5.0))


def run_on_main(fn: Callable[[], T], what: str, collective_timeout_s: float) -> Optional[T]:
    """Run `fn` on rank 0 while the other ranks wait for it; their result is None.

    `what` names the phase in the error (e.g. "waiting for a rollout batch"). Single-process
    runs call `fn` directly."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    interval = heartbeat_interval(collective_timeout_s)
    if dist.get_rank() == 0:
        return _lead(fn, what, interval)
    _follow(what)
    return None


def _lead(fn: Callable[[], T], what: str, interval: float) -> T:
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="main-rank") as pool:
        future = pool.submit(fn)
        while True:
            try:
                result = future.result(timeout=interval)
            except concurrent.futures.TimeoutError:
                _broadcast_status({"state": RUNNING})
                continue
            except BaseException as e:  # noqa: BLE001 - every rank must learn of it
                message = _describe(what, e)
                _broadcast_status({"state": FAILED, "message": message})
                logger.error("%s\n%s", message, "".join(traceback.format_exception(e)))
                raise MainRankError(message) from e
            _broadcast_status({"state": DONE})
            return result


def _follow(what: str) -> None:
    while True:
        status = _broadcast_status(None)
        if status["state"] == DONE:
            return
        if status["state"] == FAILED:
            raise MainRankError(status["message"])
        if status["state"] != RUNNING:
            raise RuntimeError(f"rank 0 sent an unknown status while {what}: {status!r}")


def _broadcast_status(status: Optional[dict]) -> dict:
    received = _broadcast_from_main(status)
    assert received is not None, "rank 0 broadcast no status"
    return received


def _broadcast_from_main(value: T) -> T:
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _describe(what: str, e: BaseException) -> str:
    return f"rank 0 failed while {what}: {type(e).__name__}: {e}"[:4000]


def share_from_main(value: T) -> T:
    """Rank 0's `value` on every rank (itself in a single-process run)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    return _broadcast_from_main(value)
