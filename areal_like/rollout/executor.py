"""WorkflowExecutor: runs many `arun_episode` coroutines under a staleness bound.

Threading model. Callers are plain synchronous code (a training step blocks its thread for
seconds), so the executor owns one daemon thread running an asyncio loop: every episode, and
the inference engine's HTTP session (it must live on the loop that uses it), runs there, while
callers use blocking methods (`submit`, `wait`, `prepare_batch`) from their own thread. In
training the executor lives in the rollout controller's process, away from the trainer's
interpreter lock (`areal_like.rollout.process`). The hand-off is a
`threading.Condition` around small queues; the loop is woken with `call_soon_threadsafe`. The
engine runs its own coroutines there with `run_coroutine(coro, timeout)`. Each episode runs in
a task of its own, whose context seeds its requests and holds its reward executor.

Flow: `submit` queues an item; the loop admits queued items while fewer than
`max_concurrent_rollouts` run and the staleness bound allows (see `staleness.py`); a finished
episode is validated, filtered by `should_accept`, and buffered; `wait(count)` takes the oldest
`count` buffered groups (dropping stale ones) and returns them as one padded TensorDict.
A workflow exception is re-raised by the next `wait` with the data item's id, chained to the
original (its traceback points into the workflow).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

from tensordict import TensorDict

from areal_like.api.config import RolloutConfig
from areal_like.api.engine_api import InferenceEngine
from areal_like.api.errors import (
    ExecutorClosedError,
    FleetUnavailableError,
    NoTrajectoriesError,
    RolloutTimeoutError,
)
from areal_like.api.seeding import begin_episode
from areal_like.api.trajectory import validate_trajectory
from areal_like.api.workflow_api import RolloutWorkflow
from areal_like.rewards.failures import RewardBudgetExceeded, failures_of
from areal_like.rewards.reward_executor import RewardExecutor, use_episode_rewards
from areal_like.rollout.data_cursor import DataCursor
from areal_like.rollout.executor_state import (
    EpisodeResult,
    ExecutorState,
    ShouldAccept,
    Submission,
    Ticket,
    workflow_error,
)
from areal_like.rollout.filter_budget import rejection_reason
from areal_like.rollout.outcome import Outcome, shortfall
from areal_like.rollout.stats import assemble_batch
from areal_like.rollout.wait_progress import WaitProgress
from areal_like.utils.batching import (
    min_generated_version,
    trajectory_from_state,
    trajectory_to_state,
)
from areal_like.utils.loop_thread import EventLoopThread

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05  # the loop re-checks admission this often (version bumps, resume)
STATE_FORMAT = 2


class WorkflowExecutor:
    """Drives `RolloutWorkflow`s against an `InferenceEngine` (the rollout controller and the
    rollout process own one).

    Call `initialize()` before use and `destroy()` at the end. All public methods are
    thread-safe; `wait` / `prepare_batch` / `rollout_batch` block the calling thread for at
    most `timeout` seconds (default `wait_timeout`).
    """

    def __init__(
        self,
        config: RolloutConfig,
        inference_engine: InferenceEngine,
        wait_timeout: float = 3600.0,
        rewards: Optional[RewardExecutor] = None,  # every episode's (see `use_episode_rewards`)
    ) -> None:
        if wait_timeout <= 0:
            raise ValueError(f"WorkflowExecutor wait_timeout={wait_timeout} must be > 0")
        self.config = config
        self.engine = inference_engine
        self.wait_timeout = wait_timeout
        self.rewards = rewards
        self._state = ExecutorState(config)
        self._loop_thread = EventLoopThread("rollout-loop", on_error=self._state.set_fatal)
        self._tasks: set[asyncio.Task] = set()
        self._cursor: Optional[DataCursor] = None
        self._restored_position: Optional[dict[str, int]] = None
        self._drawing = threading.Lock()  # draw + queue data, or state_dict: one at a time
        self._initialized = False
        self._closed = False
        self._admit_scheduled = False
        # Keep the rows of a group whose other rewards failed? Only safe when the advantage
        # estimator uses no group statistics (recipes set it from the algorithm).
        self.keep_partial_groups = False
        self.last_episode_ids: list[str] = []  # of the last batch returned

    # ---- lifecycle ----------------------------------------------------------------------
    def initialize(self, timeout: float = 10.0) -> None:
        """Start the event-loop thread (idempotent)."""
        if self._closed:
            raise ExecutorClosedError("WorkflowExecutor was destroyed; create a new one")
        if self._initialized:
            return
        self._loop_thread.start(timeout)
        self._loop_thread.call_soon(self._start_poller)
        self._initialized = True

    def destroy(self, timeout: float = 10.0) -> None:
        """Cancel queued and running episodes and stop the loop thread within `timeout` s.
        Safe to call twice. Waiters in other threads get ExecutorClosedError."""
        if self._closed:
            return
        self._closed = True
        self._state.close()
        if self._initialized:
            self._loop_thread.stop(timeout)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The rollout event loop (create the engine's aiohttp session on it)."""
        return self._loop_thread.loop

    @property
    def loop_thread(self) -> EventLoopThread:
        """The thread that runs the rollout loop (hand it to the engine's `initialize`)."""
        return self._loop_thread

    def run_coroutine(self, coro: Any, timeout: float) -> Any:
        """Run `coro` on the rollout loop from another thread; TimeoutError after `timeout` s.
        Allowed after the fleet failed (`fail`): the loop itself still runs (clean-up)."""
        if not isinstance(self._state.fatal, FleetUnavailableError):
            self._check_open()
        elif self._closed:
            raise ExecutorClosedError("WorkflowExecutor was destroyed")
        return self._loop_thread.run_coroutine(coro, timeout)

    def _check_blocking_allowed(self, what: str) -> None:
        if self._initialized and self._loop_thread.in_loop_thread():
            raise RuntimeError(
                f"{what} blocks and was called from the rollout event loop (inside a workflow?), "
                f"which would deadlock; workflows should only `await engine.agenerate(...)`"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError("WorkflowExecutor was destroyed")
        if not self._initialized:
            raise ExecutorClosedError("WorkflowExecutor.initialize() was not called")
        self._state.raise_if_fatal()

    # ---- loop side (runs on the event-loop thread) --------------------------------------
    def _start_poller(self) -> None:
        self._track(self._loop_thread.loop.create_task(self._poll()))

    async def _poll(self) -> None:
        while True:
            self._admit()
            await asyncio.sleep(POLL_INTERVAL_S)

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            # episodes catch their own errors, so this is a bug in the executor: surface it
            self._state.set_fatal(error)

    def _admit(self) -> None:
        self._admit_scheduled = False
        if self._closed:
            return
        version = self.engine.get_version()  # read outside our lock: engines may lock too
        started = self._state.admit(version)
        loop = self._loop_thread.loop
        for sub in started:
            self._track(loop.create_task(self._run_episode(sub)))

    async def _run_episode(self, sub: Submission) -> None:
        payload: Any  # the episode's result, or what stopped it
        try:
            kind, payload = await self._episode_outcome(sub)
        except asyncio.CancelledError:
            if self._closed:  # shutdown: the only cancellation that is not a failure
                self._state.finish(sub, Outcome.CANCELLED, None)
                raise
            kind, payload = Outcome.FAILED, workflow_error(sub, RuntimeError(
                "the episode was cancelled while the executor was running (an awaited task or "
                "future was cancelled by something other than shutdown)"))
        except RewardBudgetExceeded as exc:  # stops the run, as it is (it names the function)
            kind, payload = Outcome.FATAL, exc
        except Exception as exc:  # handed to the caller of wait(), chained to `exc`
            failures = failures_of(exc)
            if failures is None:
                kind, payload = Outcome.FAILED, workflow_error(sub, exc)
            else:
                kind, payload = self._reward_failed(sub, exc)
        # outside the try: a failure here is the executor's bug and becomes fatal
        self._state.finish(sub, kind, payload)
        self._kick_from_loop()

    def _reward_failed(self, sub: Submission, exc: Exception) -> tuple[Outcome, Any]:
        """A reward call of the episode failed: exclude the episode, or — when the estimator
        uses no group statistics — keep the samples whose rewards succeeded."""
        survivors = getattr(exc, "survivors", None)
        if survivors is None or not self.keep_partial_groups:
            return Outcome.FAILED_REWARD, None
        try:
            outcome = self._judge(sub, survivors)
        except Exception as judge_exc:
            return Outcome.FAILED, workflow_error(sub, judge_exc)
        partial = outcome[0] is Outcome.ACCEPTED
        return (Outcome.PARTIAL_ACCEPTED, outcome[1]) if partial else outcome

    async def _episode_outcome(self, sub: Submission) -> tuple[Outcome, Any]:
        sub.start = time.monotonic()
        begin_episode(sub.episode_seed)  # this task's context: seeds its requests in order
        if self.rewards is not None:
            use_episode_rewards(self.rewards)
        trajectory = await sub.workflow.arun_episode(self.engine, sub.data)
        if trajectory is None:
            return Outcome.REJECTED_BY_WORKFLOW, None
        return self._judge(sub, trajectory)

    @staticmethod
    def _judge(sub: Submission, trajectory: Any) -> tuple[Outcome, Any]:
        """(ACCEPTED, its EpisodeResult) or (REJECTED_BY_FILTER, why, when the filter says)."""
        validate_trajectory(trajectory)
        if sub.should_accept is not None and not sub.should_accept(trajectory):
            return Outcome.REJECTED_BY_FILTER, rejection_reason(sub.should_accept, trajectory)
        return Outcome.ACCEPTED, EpisodeResult(sub.seq, sub.data_id, trajectory, sub.bounded,
                                         time.monotonic() - sub.start,
                                         min_generated_version(trajectory), sub.episode_seed)

    def _kick_from_loop(self) -> None:
        if not self._closed:
            self._loop_thread.loop.call_soon(self._admit)

    def _kick(self) -> None:
        # one pending wake-up is enough: a burst of submits must not wake the loop per item
        if not self._closed and not self._admit_scheduled:
            self._admit_scheduled = True
            self._loop_thread.call_soon(self._admit)

    # ---- trainer side -------------------------------------------------------------------
    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept: Optional[ShouldAccept] = None,
    ) -> int:
        """Queue one data item for `workflow`; returns its submission number."""
        self._check_open()
        sub = self._state.enqueue(data, workflow, should_accept, bounded=True, respect_limit=True)
        self._kick()
        return sub.seq

    def wait(self, count: int, timeout: Optional[float] = None) -> TensorDict:
        """Block until `count` accepted, fresh groups are buffered; return the oldest `count`
        as one right-padded TensorDict, in submission order (rows of one group together)."""
        return self._wait_groups(count, timeout, refill=None, what=f"wait(count={count})")

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept: Optional[ShouldAccept] = None,
        timeout: Optional[float] = None,
    ) -> TensorDict:
        """Run `workflow` on every item (synchronous rollout) and return the accepted groups in
        the order of `data`. These items bypass the staleness bound (they are generated now
        and are not part of the asynchronous stream) but obey pause and max concurrency."""
        self._check_open()
        self._check_blocking_allowed("rollout_batch()")
        if len(data) == 0:
            raise ValueError("rollout_batch: `data` is empty")
        for i, item in enumerate(data):  # check all first: never leave half a batch queued
            if not isinstance(item, dict):
                raise TypeError(f"rollout_batch: data[{i}] is a {type(item).__name__}, not a dict")
        ticket = Ticket()
        for item in data:
            self._state.enqueue(item, workflow, should_accept, bounded=False, ticket=ticket)
        self._kick()
        timeout = self._timeout(timeout)
        version = self.engine.get_version()
        outcomes = self._state.wait_ticket(ticket, len(data), time.monotonic() + timeout,
                                           lambda: self._timeout_error(
                                               f"rollout_batch({len(data)} items)",
                                               len(data), len(ticket.outcomes), timeout,
                                               version))
        version = self.engine.trainer_version()  # what the batch is trained by
        results = self._state.drop_stale_results(outcomes, version)
        if len(results) < len(data):  # never fewer rows without saying why
            message = (f"rollout_batch: {len(results)} of {len(data)} items gave a trajectory "
                       f"to train on ({shortfall([kind for kind, _ in outcomes], len(results))})")
            if not results:
                raise NoTrajectoriesError(message)
            logger.warning("%s", message)
        return self._assemble(results, version)

    def prepare_batch(self, dataloader: Iterable[Any], workflow: RolloutWorkflow,
                      should_accept: Optional[ShouldAccept] = None,
                      timeout: Optional[float] = None) -> TensorDict:
        """Keep the pipeline full from `dataloader` (cycled epoch after epoch) and return the
        next `consumer_batch_size` groups. The executor owns the position in the dataloader
        (see `state_dict`); always pass the same dataloader (or, after a restore, an equal
        one)."""
        self._check_open()
        with self._drawing:
            cursor = self._cursor_for(dataloader)
            self._state.resubmit_restored(workflow, should_accept)

        def refill(need: int) -> None:
            with self._drawing:
                while need > 0:
                    items = cursor.next_items()
                    for item in items:
                        self._state.enqueue(item, workflow, should_accept, bounded=True)
                    need -= len(items)

        batch = self.config.staleness.consumer_batch_size
        return self._wait_groups(batch, timeout, refill, what=f"prepare_batch({batch} groups)")

    def _cursor_for(self, dataloader: Iterable[Any]) -> DataCursor:
        if self._cursor is None:
            position = self._restored_position or {}
            self._cursor = DataCursor(dataloader, **position)
            self._restored_position = None
        elif self._cursor.loader is not dataloader:
            raise ValueError("prepare_batch got a different dataloader than before; the executor "
                             "tracks the position of one dataloader. Call "
                             "reset_data_position() to switch loaders.")
        return self._cursor

    def episode_seed(self, data: dict[str, Any]) -> int:
        """The seed of the next rollout of `data`, for episodes run outside `submit` (such as
        evaluation); it counts as a rollout of that item (see `areal_like.api.seeding`)."""
        return self._state.episode_seed(data)

    def reset_data_position(self) -> None:
        """Forget the dataloader and its position (the next prepare_batch starts at 0)."""
        self._cursor = None
        self._restored_position = None

    def _timeout(self, timeout: Optional[float]) -> float:
        timeout = self.wait_timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        return timeout

    def _wait_groups(self, count: int, timeout: Optional[float],
                     refill: Optional[Callable[[int], None]], what: str) -> TensorDict:
        self._check_open()
        self._check_blocking_allowed(what)
        if count < 1:
            raise ValueError(f"{what}: count must be >= 1")
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        progress = WaitProgress(what, count)  # a line every ~30 s while the wait lasts
        self._kick()
        while True:
            version = self.engine.trainer_version()  # what the batch is trained by

            def timeout_error(v: int = version) -> Exception:  # counts the ready groups then
                return self._timeout_error(what, count, len(self._state.ready), timeout, v)

            taken, need = self._state.take_or_wait(
                count, version, deadline, refill is not None, timeout_error,
                on_drop=self._kick,
            )
            if taken is not None:  # in submission order: the layout never depends on timing
                return self._assemble(sorted(taken, key=lambda r: r.seq), version)
            if refill is not None and need > 0:
                refill(need)
                self._kick()
            progress.tick(len(self._state.ready), functools.partial(self._state.describe, version))

    def _timeout_error(self, what: str, count: int, have: int, timeout: float,
                       version: int) -> RolloutTimeoutError:
        return RolloutTimeoutError(f"{what} timed out after {timeout:.3g} s with {have} of "
                                   f"{count} groups ready; " + self._state.describe(version))

    def _assemble(self, results: list[EpisodeResult], version: int) -> TensorDict:
        batch, last = assemble_batch(results, version, self._state.snapshot(version))
        self._state.last_batch = last
        self.last_episode_ids = [r.episode_id for r in results]
        return batch

    # ---- admission control --------------------------------------------------------------
    def pause(self) -> None:
        """Stop admitting new episodes; running ones continue and are buffered."""
        self._state.set_paused(True)

    def resume(self) -> None:
        """Admit episodes again."""
        self._state.set_paused(False)
        if self._initialized and not self._closed:
            self._kick()

    def buffered_episode_ids(self) -> list[str]:
        """The episodes finished and waiting to be consumed, oldest first."""
        with self._state.cond:
            return [r.episode_id for r in self._state.ready]

    def fail(self, error: BaseException) -> None:
        """Make every wait (and the next one) raise `error`: the rollout side cannot go on
        (e.g. the engine lost its inference servers)."""
        self._state.set_fatal(error)

    @property
    def paused(self) -> bool:
        return self._state.paused

    # ---- statistics ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, gauges and the statistics of the last consumed batch."""
        return self._state.snapshot(self.engine.get_version())

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything exact resume needs: counters, version, dataloader position, buffered
        groups (as plain tensors/lists, `torch.load(weights_only=True)`-readable when the
        data items are) and the data items drawn but not yet finished (they are re-run after
        a restore). A pending workflow error is raised here rather than lost."""
        self._state.raise_if_fatal()
        version = self.engine.get_version()
        with self._drawing:
            snapshot = self._state.checkpoint()
            position = self._cursor.position() if self._cursor else self._restored_position
        return {
            "format": STATE_FORMAT,
            "version": version,
            "counters": snapshot["counters"],
            "buffered": [
                {"seq": r.seq, "data_id": r.data_id, "latency": r.latency,
                 "min_version": r.min_version, "episode_seed": r.episode_seed,
                 "trajectory": trajectory_to_state(r.trajectory)}
                for r in snapshot["ready"]
            ],
            "pending_data": [data for data, _ in snapshot["pending"]],
            "pending_seeds": [seed for _, seed in snapshot["pending"]],
            "data_position": position,
            "paused": snapshot["paused"],
            "next_seq": snapshot["next_seq"],
            "seed": snapshot["seed"],
            "rollouts_of": snapshot["rollouts_of"],
            "start_version": snapshot["start_version"],
        }

    def load_state_dict(self, state: dict[str, Any], restore_version: bool = True) -> None:
        """Restore `state_dict()` into this executor, which must hold no work yet. With
        `restore_version` the engine's version is set to the saved one."""
        for key in ("format", "version", "counters", "buffered", "pending_data",
                    "pending_seeds", "data_position", "paused", "next_seq", "seed",
                    "rollouts_of"):
            if key not in state:
                raise KeyError(f"executor state is missing '{key}'; got keys {sorted(state)}")
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"executor state format {state['format']} != {STATE_FORMAT}")
        ready = [
            EpisodeResult(int(b["seq"]), str(b["data_id"]), trajectory_from_state(b["trajectory"]),
                          True, float(b["latency"]), b["min_version"],
                          int(b.get("episode_seed", -1)))
            for b in state["buffered"]
        ]
        pending = list(zip(state["pending_data"], map(int, state["pending_seeds"]), strict=True))
        self._state.restore(state["counters"], ready, pending, bool(state["paused"]),
                            int(state["next_seq"]), int(state["seed"]),
                            {str(k): int(v) for k, v in state["rollouts_of"].items()},
                            state.get("start_version", 0))  # older states: began at 0
        self._cursor = None
        self._restored_position = dict(state["data_position"]) if state["data_position"] else None
        if restore_version:
            self.engine.set_version(int(state["version"]))

    def resubmit_restored(self, workflow: RolloutWorkflow,
                          should_accept: Optional[ShouldAccept] = None) -> int:
        """Re-queue the unfinished data items of a restored state (prepare_batch does this
        itself); returns how many. For users of plain submit/wait."""
        self._check_open()
        with self._drawing:
            n = self._state.resubmit_restored(workflow, should_accept)
        self._kick()
        return n
