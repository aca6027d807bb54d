"""Run reward functions without blocking the rollout event loop, each call bounded in time.

Sync reward functions run in a `pebble` process pool (verifiers like math-verify or sympy can
hang or hold the GIL for seconds): a call's timeout clock starts when a worker starts it, not
while it queues, and a call that overruns is stopped by terminating its worker alone — the
calls running beside it are not affected and the pool replaces the worker (a pool that
breaks is replaced too: `worker_pool`). Async reward functions are awaited directly; with
`use_processes=False` sync functions run in threads (the timeout then marks the sample
failed, but a hung thread cannot be stopped). Functions marked `@inline_reward` (cheap,
cannot hang) run in the caller's thread (`run_inline`).

A call that raises, times out, crashes its worker or returns something other than a finite
real number raises `RewardFailure` — never a 0.0 — and is counted (`reward/failed`,
`reward/timeouts`, and per function `reward/<name>/...`). The error budget
(`RewardConfig.max_failure_rate` over `failure_window`) turns too many failures of one
function into `RewardBudgetExceeded`, which stops the run. `on_failure="constant"` is the
explicit opt-in to train on `failure_reward` instead (still counted and budgeted).

Whoever runs episodes owns the executor and hands it to each episode explicitly: the rollout
controller (`RolloutController(rewards=...)`, else one of its own) sets it in each episode's
context (`use_episode_rewards`, as it seeds the episode's requests), and a workflow uses the
executor it was built with, else its episode's (`episode_rewards`). No executor is
process-global: one sent to another process arrives as a new executor with the same settings
(pools, locks and budgets never cross a process boundary).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import threading
import time
import traceback
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Awaitable, Callable, Optional, TypeVar

from pebble import ProcessExpired

from areal_like.api.config import RewardConfig
from areal_like.rewards import pool_worker
from areal_like.rewards.budget import FailureBudget
from areal_like.rewards.checks import (
    check_picklable,
    check_signature,
    reward_name,
    where_defined,
    worker_load_hint,
)
from areal_like.rewards.convention import TokenIds, invoke
from areal_like.rewards.failures import RewardFailure, RewardFunctionError
from areal_like.rewards.inline import is_inline
from areal_like.rewards.worker_pool import PoolBroke, PoolStopped, RewardWorkers
from areal_like.utils import stats_tracker

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError)
RESENDS = 2  # times a call caught in a broken worker pool is sent to its replacement


class RewardExecutor:
    """Evaluate `reward_fn(prompt, completion, **data)` safely from async code."""

    def __init__(self, config: Optional[RewardConfig] = None) -> None:
        self.config = config or RewardConfig()
        self.budget = FailureBudget(self.config.max_failure_rate, self.config.failure_window)
        self.n_calls = 0
        self.failures: Counter[str] = Counter()  # by kind
        self.workers = RewardWorkers(self.config.max_workers, self.config.worker_start)
        self._threads: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._stuck_threads = 0  # threads still running a call that timed out
        self._lock = threading.Lock()
        self._logged_first: set[str] = set()

    @property
    def n_failed(self) -> int:
        return sum(self.failures.values())

    # ---- pools --------------------------------------------------------------------------
    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(
                    self.config.max_workers, thread_name_prefix="reward")
            return self._threads

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process (a workflow built with its own executor, going to the
        # rollout controller): a new executor there, with the same settings.
        return RewardExecutor, (self.config,)

    def shutdown(self) -> None:
        """Stop the workers (running calls are terminated). Safe to call twice."""
        with self._lock:
            threads, self._threads = self._threads, None
        self.workers.shutdown()
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)

    # ---- fail fast ----------------------------------------------------------------------
    def check_early(self, fn: Callable[..., Any]) -> None:
        """The checks that need no data and no worker (cheap; workflows run them when they
        are built): `fn` takes (prompt, completion, ...) and can be sent to workers."""
        check_signature(fn, None)
        if self._in_workers(fn):
            check_picklable(fn)

    def check(self, fn: Callable[..., Any], data: Optional[dict[str, Any]] = None,
              load_in_worker: bool = True) -> None:
        """Raise `RewardFunctionError` unless `fn` can be called with the documented
        signature on `data` (a dataset item) and, when it will run in worker processes, be
        sent to one and (with `load_in_worker`) loaded there, bounded by `startup_timeout`.
        Blocks; call it before training starts, not from the event loop."""
        check_signature(fn, data)
        if not self._in_workers(fn):
            return
        check_picklable(fn)
        if not load_in_worker:
            return
        try:
            pool, future = self.workers.schedule(fn, pool_worker.ready, (fn,))
            self.workers.wait(pool, future, self.config.startup_timeout)
        except BrokenProcessPool as e:
            raise RewardFunctionError(
                f"reward worker processes could not start (reward.worker_start="
                f"{self.config.worker_start}; the cause is printed above): {e!r}; "
                f"reward.worker_start=spawn starts each worker by importing the program "
                f"instead") from e
        except _TIMEOUTS:
            raise RewardFunctionError(
                f"reward worker processes did not load reward function {reward_name(fn)} "
                f"(from {where_defined(fn)}) within reward.startup_timeout="
                f"{self.config.startup_timeout} s; {worker_load_hint(fn)}") from None
        except PoolBroke as e:  # every worker exited before one could take the call
            raise RewardFunctionError(
                f"reward worker processes could not load reward function {reward_name(fn)} "
                f"(from {where_defined(fn)}): they exited before loading it (the cause is "
                f"printed above: {e}); {worker_load_hint(fn)}") from e
        except Exception as e:
            raise RewardFunctionError(
                f"reward worker processes could not load reward function {reward_name(fn)} "
                f"(from {where_defined(fn)}): {type(e).__name__}: {e}; {worker_load_hint(fn)}"
            ) from e

    def _inline(self, fn: Callable[..., Any]) -> bool:
        return self.config.run_inline and is_inline(fn)

    def _in_workers(self, fn: Callable[..., Any]) -> bool:
        return (self.config.use_processes and not inspect.iscoroutinefunction(fn)
                and not self._inline(fn))

    # ---- calls --------------------------------------------------------------------------
    async def __call__(self, reward_fn: Callable[..., Any], prompt: str, completion: str,
                       *, token_ids: TokenIds = None, **data: Any) -> float:
        """The reward, or `RewardFailure` (see module doc). `token_ids` = (prompt ids,
        completion ids), for functions of AReaL-lite's convention."""
        name = reward_name(reward_fn)
        try:
            if inspect.iscoroutinefunction(reward_fn):
                value = await self._call_async(reward_fn, prompt, completion, data, token_ids)
            elif self._inline(reward_fn):
                value = self._call_inline(reward_fn, prompt, completion, data, token_ids)
            elif self.config.use_processes:
                value = await self._call_in_process(reward_fn, prompt, completion, data, token_ids)
            else:
                value = await self._call_in_thread(reward_fn, prompt, completion, data, token_ids)
        except RewardFailure as failure:
            return self._failed(name, failure)
        self.record(name, None)
        return value

    def record(self, name: str, failure: Optional[RewardFailure]) -> None:
        """Count one call of reward `name` made outside `__call__` (e.g. a process reward
        model over HTTP, which returns a score per step): same stats, logs and error budget;
        raises RewardBudgetExceeded past the budget. The caller excludes a failed sample."""
        self.n_calls += 1
        if failure is None:
            stats_tracker.add(**{"reward/calls": 1})
            self.budget.record(name, None)
            return
        self.failures[failure.kind] += 1
        counts = {"reward/calls": 1, "reward/failed": 1, f"reward/{name}/failed": 1}
        if failure.kind == "timeout":
            counts |= {"reward/timeouts": 1, f"reward/{name}/timeouts": 1}
        stats_tracker.add(**counts)
        if name not in self._logged_first:
            self._logged_first.add(name)
            logger.error("%s (first failure of this function; failed samples are excluded "
                         "from training)%s", failure,
                         f"\n{failure.traceback_text}" if failure.traceback_text else "")
        else:
            logger.warning("%s", failure)
        self.budget.record(name, failure)  # raises RewardBudgetExceeded past the budget

    def _failure(self, fn: Callable[..., Any], outcome: tuple) -> RewardFailure:
        kind, detail = outcome[0], outcome[1]
        return RewardFailure(reward_name(fn), kind, detail, outcome[2] if len(outcome) > 2 else "")

    async def _call_async(self, fn: Callable[..., Any], prompt: str, completion: str,
                          data: dict[str, Any], ids: TokenIds = None) -> float:
        try:
            call = invoke(fn, prompt, completion, data, ids)
            # a self-timed function (the remote RM) bounds its requests itself: a clock here
            # would count its batching window as work
            value = await (call if _self_timed(fn) else
                           asyncio.wait_for(call, self.config.timeout))
        except _TIMEOUTS:
            raise self._timeout(fn) from None
        except RewardFailure:
            raise
        except Exception as e:
            raise RewardFailure(reward_name(fn), "raised", f"{type(e).__name__}: {e}",
                                traceback.format_exc()) from e
        return self._coerce(fn, value)

    def _call_inline(self, fn: Callable[..., Any], prompt: str, completion: str,
                     data: dict[str, Any], ids: TokenIds = None) -> float:
        start = time.thread_time()  # the work itself: waiting for the CPU does not count
        outcome = pool_worker.call_reward(fn, prompt, completion, data, ids)
        used = time.thread_time() - start
        if used > self.config.timeout:  # in a worker it would have been stopped: same verdict
            raise RewardFailure(reward_name(fn), "timeout",
                                f"took {used:.2f} s of CPU inline, more than reward.timeout="
                                f"{self.config.timeout} s (is it really @inline_reward?)")
        if outcome[0] != "ok":
            raise self._failure(fn, outcome)
        return float(outcome[1])

    async def _call_in_process(self, fn: Callable[..., Any], prompt: str, completion: str,
                               data: dict[str, Any], ids: TokenIds = None) -> float:
        try:
            outcome = await self._run_in_workers(fn, (fn, prompt, completion, data, ids))
        except _TIMEOUTS:
            raise self._timeout(fn) from None
        except ProcessExpired as e:
            raise RewardFailure(reward_name(fn), "crashed",
                                f"worker exit code {e.exitcode}") from None
        except PoolStopped as e:
            raise RewardFailure(reward_name(fn), "raised", f"could not run: {e}") from None
        except (PoolBroke, BrokenProcessPool) as e:
            raise RewardFailure(reward_name(fn), "crashed", (
                f"not run: the reward worker pool broke {RESENDS + 1} times before the call "
                f"started ({e}; the workers' own errors are printed above)")) from None
        except Exception as e:  # e.g. the data could not be pickled to the worker
            raise RewardFailure(reward_name(fn), "raised",
                                f"could not run in a worker: {type(e).__name__}: {e}") from e
        if outcome[0] != "ok":
            raise self._failure(fn, outcome)
        return float(outcome[1])

    async def _run_in_workers(self, fn: Callable[..., Any], args: tuple) -> tuple:
        """`pool_worker.call_reward(*args)` in a worker; a call caught in a broken pool is
        sent again to its replacement, `RESENDS` times at most (see `PoolBroke`)."""
        for resend in range(RESENDS + 1):
            try:
                pool, future = self.workers.schedule(fn, pool_worker.call_reward, args,
                                                     timeout=self.config.timeout)
                return await self.workers.result(pool, future)
            except (PoolBroke, BrokenProcessPool):
                if resend == RESENDS:
                    raise
                stats_tracker.add(**{"reward/resent": 1})
        raise AssertionError("unreachable")

    async def _call_in_thread(self, fn: Callable[..., Any], prompt: str, completion: str,
                              data: dict[str, Any], ids: TokenIds = None) -> float:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()

        def run() -> tuple:
            loop.call_soon_threadsafe(_set_once, started)
            return pool_worker.call_reward(fn, prompt, completion, data, ids)

        call = self._thread_pool().submit(run)
        result = asyncio.wrap_future(call)
        await self._thread_started(fn, started, call)  # queueing is not execution: the clock
        try:                                            # starts now
            outcome = await asyncio.wait_for(asyncio.shield(result), self.config.timeout)
        except _TIMEOUTS:
            logger.error("reward %s still runs in a thread after its timeout; threads cannot be "
                         "stopped (reward.use_processes=true can)", reward_name(fn))
            with self._lock:
                self._stuck_threads += 1
            call.add_done_callback(lambda _: self._thread_freed())
            raise self._timeout(fn) from None
        if outcome[0] != "ok":
            raise self._failure(fn, outcome)
        return float(outcome[1])

    async def _thread_started(self, fn: Callable[..., Any], started: asyncio.Future[None],
                              call: concurrent.futures.Future[Any]) -> None:
        """Wait for a thread to take the call; fail it when it never can: the pool was shut
        down (queued calls are cancelled), or every thread runs a call that timed out."""
        while not started.done():
            try:
                await asyncio.wait({started}, timeout=1.0)
            except asyncio.CancelledError:
                call.cancel()  # not started yet: it never will be
                raise
            if started.done():
                return
            if call.cancelled():
                raise RewardFailure(reward_name(fn), "raised", "could not run: the reward "
                                    "executor was shut down before the call started")
            if self._stuck_threads >= self.config.max_workers and call.cancel():
                raise RewardFailure(reward_name(fn), "timeout", (
                    f"not started: all {self.config.max_workers} reward threads still run calls "
                    f"that timed out (reward.use_processes=true can stop them)"))

    def _thread_freed(self) -> None:
        with self._lock:
            self._stuck_threads -= 1

    def _timeout(self, fn: Callable[..., Any]) -> RewardFailure:
        return RewardFailure(reward_name(fn), "timeout",
                             f"no result {self.config.timeout} s after it started "
                             f"(reward.timeout)")

    def _coerce(self, fn: Callable[..., Any], value: Any) -> float:
        try:
            return pool_worker.coerce_reward(value)
        except pool_worker.InvalidReward as e:
            raise RewardFailure(reward_name(fn), "invalid", str(e)) from None

    def _failed(self, name: str, failure: RewardFailure) -> float:
        self.record(name, failure)
        if self.config.on_failure == "constant":
            return self.config.failure_reward
        raise failure


def _self_timed(fn: Callable[..., Any]) -> bool:
    return bool(getattr(getattr(fn, "__self__", fn), "self_timed", False))


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# ---- the episode's executor ------------------------------------------------------------
_EPISODE_REWARDS: contextvars.ContextVar[Optional[RewardExecutor]] = contextvars.ContextVar(
    "areal_like_episode_rewards", default=None)


def use_episode_rewards(rewards: RewardExecutor) -> None:
    """Give the episode running in the current asyncio task (and the tasks it starts) its
    reward executor. Call it at the top of that task: each task has its own copy of the
    context."""
    _EPISODE_REWARDS.set(rewards)


async def with_episode_rewards(rewards: RewardExecutor, work: Awaitable[T]) -> T:
    """Await `work` (e.g. a held-out evaluation's episodes) with `rewards` as its episodes'
    executor; run it as a task of its own (`run_coroutine`), so the setting ends with it."""
    use_episode_rewards(rewards)
    return await work


def episode_rewards() -> RewardExecutor:
    """The reward executor of the running episode (see `use_episode_rewards`)."""
    rewards = _EPISODE_REWARDS.get()
    if rewards is None:
        raise RuntimeError(
            "no reward executor for this episode: run the workflow through a "
            "RolloutController or WorkflowExecutor (they hand each episode theirs), or build "
            "it with one (reward_executor=RewardExecutor(RewardConfig(...)))")
    return rewards


def check_reward_early(fn: Callable[..., Any], rewards: Optional[RewardExecutor]) -> None:
    """The checks a workflow runs on its reward function when it is built: the signature,
    and, with an executor that will send `fn` to its workers, that it can be sent (without
    one, the episode's executor checks it: `RewardExecutor.check`)."""
    if rewards is None:
        check_signature(fn, None)
    else:
        rewards.check_early(fn)


class UsesRewards:
    """A workflow's reward executor: the one it was built with, else its episode's."""

    _reward_executor: Optional[RewardExecutor] = None

    def use_rewards(self, reward_fn: Callable[..., Any],
                    reward_executor: Optional[RewardExecutor]) -> None:
        self._reward_executor = reward_executor
        check_reward_early(reward_fn, reward_executor)

    @property
    def reward_executor(self) -> RewardExecutor:
        return self._reward_executor or episode_rewards()


__all__ = ["RewardExecutor", "RewardFailure", "RewardFunctionError", "UsesRewards",
           "episode_rewards", "use_episode_rewards", "with_episode_rewards"]
