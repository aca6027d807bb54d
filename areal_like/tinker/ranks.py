"""The trainer ranks behind the Tinker API: rank 0 (which serves HTTP) runs each training call
on one thread of its own, in submission order, after broadcasting it to the other ranks, which
`follow` and make the same call, so FSDP's collectives meet. While idle, rank 0 broadcasts a
no-op every `heartbeat_s`: a follower's wait is bounded (a dead rank 0 ends the followers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from areal_like.tinker.errors import TinkerError
from areal_like.tinker.trainer import TinkerTrainer

logger = logging.getLogger(__name__)
_NOOP, _STOP = "noop", "stop"


def control_group(heartbeat_s: float) -> Optional[Any]:
    """A gloo group for the calls' broadcast (None on one rank), its waits bounded by a few
    heartbeats. Collective: every rank calls it once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=6 * heartbeat_s))


class TrainerRanks:
    """Rank 0's side: `submit` queues a call of a `TinkerTrainer` method and returns its
    future (on the caller's event loop)."""

    def __init__(self, trainer: TinkerTrainer, group: Optional[Any],
                 heartbeat_s: float = 20.0) -> None:
        self.trainer, self.group, self.heartbeat_s = trainer, group, heartbeat_s
        self._queue: queue.Queue[Optional[tuple[str, tuple[Any, ...], Any, Any]]] = \
            queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tinker-trainer", daemon=True)
        self.busy = False
        self.dead: Optional[str] = None  # why the ranks stopped

    def start(self) -> None:
        self._thread.start()

    def submit(self, method: str, *args: Any) -> asyncio.Future[Any]:
        """Queued now (calls run in the order they are submitted); once the ranks have
        stopped (a rank died), every call fails with the reason."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put((method, args, loop, future))
        if self.dead is not None:
            self._fail_queued()
        return future

    def stop(self, timeout: float = 600.0) -> None:
        """After the calls queued so far; the followers return too."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _broadcast(self, call: tuple[str, tuple[Any, ...]]) -> None:
        if self.group is not None:
            dist.broadcast_object_list([call], src=0, group=self.group)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # e.g. a collective timed out: a rank is gone
            self.dead = f"{type(e).__name__}: {e}"
            logger.exception("the trainer ranks stopped")
        finally:
            if self.dead is None:
                self.dead = "the server is shutting down"
            self._fail_queued()

    def _serve(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.heartbeat_s)
            except queue.Empty:
                self._broadcast((_NOOP, ()))
                continue
            if item is None:
                self._broadcast((_STOP, ()))
                return
            method, args, loop, future = item
            self.busy = True
            try:
                self._broadcast((method, args))
                result = getattr(self.trainer, method)(*args)
            except TinkerError as e:  # the request's fault; the ranks go on
                _resolve(loop, future, error=e)
            except Exception as e:
                logger.exception("trainer call %s failed", method)
                _resolve(loop, future, error=e)
            else:
                _resolve(loop, future, result=result)
            finally:
                self.busy = False

    def _fail_queued(self) -> None:
        error = RuntimeError(f"the trainer ranks have stopped ({self.dead})")
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _resolve(item[2], item[3], error=error)


def follow(trainer: TinkerTrainer, group: Any) -> None:
    """A rank > 0: make every call rank 0 broadcasts, until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        method, args = box[0]
        if method == _STOP:
            return
        if method == _NOOP:
            continue
        try:
            getattr(trainer, method)(*args)
        except TinkerError:
            continue  # the same request error rank 0 reports to the client
        except Exception:  # rank 0 fails that request; this rank serves the next ones
            logger.exception("trainer call %s failed on this rank", method)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any = None,
             error: Optional[BaseException] = None) -> None:
    """Settle `future` on its loop, from any thread (nothing to do once the loop closed)."""
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it any more
        loop.call_soon_threadsafe(settle)
