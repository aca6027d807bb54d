"""The reward executor's worker processes: a `pebble` pool, replaced when it breaks.

pebble gives up its whole pool when a worker exits abnormally while no call runs (a worker
killed while idle, say by the out-of-memory killer, or workers that die while starting), and
leaves the calls it had queued but not handed out pending forever. So every wait here
watches its pool: a call caught in a broken pool raises `PoolBroke` (it never started, so
it can be sent again), and the next call gets a fresh pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional

from pebble import ProcessPool

from areal_like.rewards.worker_start import worker_context

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often a waiting call looks whether its pool still works


class PoolBroke(Exception):
    """The worker pool broke before this call's result came back. In pebble's usual break
    (a worker exiting while no call runs) no call it held had started; a reward depends on
    its inputs alone, so sending the call again is safe either way."""


class PoolStopped(Exception):
    """The executor was shut down before this call started."""


class RewardWorkers:
    """A process pool started on first use, replaced when it breaks (`replaced` counts)."""

    def __init__(self, max_workers: int, start_method: str) -> None:
        self.max_workers = max_workers
        self.start_method = start_method
        self.replaced = 0
        self._pool: Optional[ProcessPool] = None
        self._stopped: weakref.WeakSet[ProcessPool] = weakref.WeakSet()
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._pool is not None

    def pool(self, fn: Optional[Callable[..., Any]] = None) -> ProcessPool:
        """The working pool, started (never a plain fork: the caller runs threads and an
        event loop) or replacing a broken one."""
        with self._lock:
            if self._pool is not None and not _works(self._pool):
                broken, self._pool = self._pool, None
                self.replaced += 1
                logger.warning("reward worker pool broke (a worker exited while no call ran); "
                               "starting a new one (%d so far)", self.replaced)
                threading.Thread(target=_dispose, args=(broken,), daemon=True,
                                 name="reward-pool-dispose").start()
            if self._pool is None:
                self._pool = ProcessPool(max_workers=self.max_workers,
                                         context=worker_context(self.start_method, fn))
            return self._pool

    def schedule(self, fn: Optional[Callable[..., Any]], target: Callable[..., Any],
                 args: tuple, timeout: Optional[float] = None
                 ) -> tuple[ProcessPool, concurrent.futures.Future[Any]]:
        """Send `target(*args)` to a worker (`timeout` counts from when one starts it).
        `BrokenProcessPool`: the pool could not start its workers."""
        pool = self.pool(fn)
        try:
            return pool, pool.schedule(target, args=args, timeout=timeout)
        except BrokenProcessPool:
            raise
        except RuntimeError as e:  # pebble: the pool broke since `pool()` looked
            raise PoolBroke(str(e)) from e

    async def result(self, pool: ProcessPool, future: concurrent.futures.Future[Any]) -> Any:
        """The call's result, or `PoolBroke`/`PoolStopped` when its pool ended first."""
        waiting = asyncio.wrap_future(future)
        while True:
            try:
                done, _ = await asyncio.wait({waiting}, timeout=WATCH_INTERVAL_S)
            except asyncio.CancelledError:
                future.cancel()
                raise
            if done:
                return _outcome(waiting)  # retrieved from the awaited copy, so none is left unread
            self._raise_if_ended(pool, future)

    def wait(self, pool: ProcessPool, future: concurrent.futures.Future[Any],
             timeout: float) -> Any:
        """Blocking `result`; `TimeoutError` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                future.cancel()
                raise TimeoutError(f"no result within {timeout} s")
            concurrent.futures.wait([future], timeout=min(left, WATCH_INTERVAL_S))
            self._raise_if_ended(pool, future)
        return _outcome(future)

    def _raise_if_ended(self, pool: ProcessPool, future: concurrent.futures.Future[Any]
                        ) -> None:
        if future.done() or _works(pool):
            return
        future.cancel()
        if pool in self._stopped:
            raise PoolStopped("the reward executor was shut down before the call started")
        raise PoolBroke("the reward worker pool broke before the call started")

    def shutdown(self) -> None:
        """Stop the workers (running calls are terminated). Safe to call twice."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None:
                self._stopped.add(pool)
        if pool is not None:
            pool.stop()
            pool.join(timeout=30)


def _outcome(future: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> Any:
    error = future.exception()
    if isinstance(error, BrokenProcessPool):  # the pool aborted the calls it held, unstarted
        raise PoolBroke(str(error))  # (one error object shared by all: not re-raised)
    return future.result()


def _works(pool: ProcessPool) -> bool:
    try:
        return pool.active
    except BrokenProcessPool:  # it tried again to start the workers it could not start
        return False


def _dispose(pool: ProcessPool) -> None:
    try:
        pool.stop()
        pool.join(timeout=30)
    except Exception:  # already broken; its worker processes are stopped or gone
        logger.warning("disposing of a broken reward worker pool", exc_info=True)
