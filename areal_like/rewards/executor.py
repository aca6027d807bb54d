"""Run reward functions without blocking the rollout event loop, each call bounded in time.

Sync reward functions run in a process pool (verifiers like math-verify or sympy can hang or
hold the GIL for seconds); async reward functions are awaited directly. A reward that raises
or times out yields 0.0 and is logged and counted, or raises when `on_error="raise"`.
A timed-out worker cannot be interrupted, so the pool is torn down (its processes killed) and
rebuilt on the next call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import multiprocessing
import threading
from typing import Any, Callable, Literal, Optional

from areal_like.rewards import pool_worker
from areal_like.utils import stats_tracker

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed or timed out (raised only with `on_error="raise"`)."""


class RewardExecutor:
    """Evaluate `reward_fn(prompt, completion, **data)` safely from async code."""

    def __init__(
        self,
        max_workers: int = 1,
        timeout: float = 15.0,
        on_error: Literal["zero", "raise"] = "zero",
        use_processes: bool = True,
        startup_timeout: float = 120.0,
    ) -> None:
        if on_error not in ("zero", "raise"):
            raise ValueError(f"RewardExecutor.on_error={on_error!r}; expected 'zero' or 'raise'")
        self.max_workers = max_workers
        self.timeout = timeout
        self.on_error = on_error
        self.use_processes = use_processes
        self.startup_timeout = startup_timeout
        self.n_calls = 0
        self.n_errors = 0
        self.n_timeouts = 0
        self._pool: Optional[concurrent.futures.Executor] = None
        self._lock = threading.Lock()

    async def _get_pool(self) -> concurrent.futures.Executor:
        """The pool, started and warmed up first: worker start-up does not count against a
        reward's timeout (it can take seconds on a loaded machine)."""
        with self._lock:
            pool, fresh = self._pool, self._pool is None
            if pool is None:
                if self.use_processes:
                    # spawn: forking a process that runs threads and an event loop is unsafe
                    ctx = multiprocessing.get_context("spawn")
                    pool = concurrent.futures.ProcessPoolExecutor(self.max_workers, mp_context=ctx)
                else:
                    pool = concurrent.futures.ThreadPoolExecutor(self.max_workers)
                self._pool = pool
        if fresh:
            loop = asyncio.get_running_loop()
            warmups = [loop.run_in_executor(pool, pool_worker.ready)
                       for _ in range(self.max_workers)]
            await asyncio.wait_for(asyncio.gather(*warmups), timeout=self.startup_timeout)
        return pool

    def _kill_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        if isinstance(pool, concurrent.futures.ProcessPoolExecutor):
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(
        self, reward_fn: Callable[..., Any], prompt: str, completion: str, **data: Any
    ) -> float:
        self.n_calls += 1
        name = getattr(reward_fn, "__qualname__", repr(reward_fn))
        try:
            if inspect.iscoroutinefunction(reward_fn):
                value = await asyncio.wait_for(
                    reward_fn(prompt, completion, **data), timeout=self.timeout
                )
            else:
                loop = asyncio.get_running_loop()
                pool = await self._get_pool()
                future = loop.run_in_executor(
                    pool, pool_worker.call_reward, reward_fn, prompt, completion, data
                )
                value = await asyncio.wait_for(future, timeout=self.timeout)
            return float(value)
        except asyncio.TimeoutError as e:
            self.n_timeouts += 1
            stats_tracker.add(**{"reward/timeouts": 1})
            if not inspect.iscoroutinefunction(reward_fn):
                self._kill_pool()
            return self._fail(f"reward {name} timed out after {self.timeout}s", e)
        except Exception as e:
            self.n_errors += 1
            stats_tracker.add(**{"reward/errors": 1})
            return self._fail(f"reward {name} raised {type(e).__name__}: {e}", e)

    def _fail(self, message: str, cause: BaseException) -> float:
        if self.on_error == "raise":
            raise RewardError(message) from cause
        logger.warning("%s; using reward 0.0", message)
        return 0.0

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
