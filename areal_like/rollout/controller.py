"""RolloutController: the rollout side of a run in one object.

It joins an inference engine client (e.g. `RemoteSGLangEngine`, which only talks to servers)
and the `WorkflowExecutor` that drives workflows on it: the engine's HTTP session lives on the
executor's event loop, and a fleet the engine loses fails the executor's waits. Everything a
trainer asks of the rollout side goes through it: batches (`prepare_batch`, `rollout_batch`,
`submit`/`wait`), weight updates, pause/resume, versions, exact-resume state.

Work that must see one policy version from start to end (held-out evaluation) is started with
`run_at_version`: it runs on the rollout loop next to training rollouts, and a weight update
waits for it to finish before it changes the weights. The controller runs in the trainer's
process (tests, scripts) or in a process of its own (`areal_like.rollout.process`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Optional

from tensordict import TensorDict

from areal_like.api.config import RolloutConfig
from areal_like.api.engine_api import InferenceEngine
from areal_like.api.io_struct import (
    FleetView,
    ModelRequest,
    ModelResponse,
    UpdateReport,
    WeightUpdateMeta,
)
from areal_like.api.rollout_api import HeldOutEvaluation, RolloutAPI, ShouldAccept
from areal_like.api.workflow_api import RolloutWorkflow
from areal_like.rewards.reward_executor import RewardExecutor, with_episode_rewards
from areal_like.rollout.executor import WorkflowExecutor
from areal_like.utils import stats_tracker


class RolloutController(InferenceEngine, RolloutAPI):
    """An engine client plus the executor that runs workflows on it (see module doc)."""

    def __init__(self, config: RolloutConfig, engine: InferenceEngine,
                 wait_timeout: float = 3600.0, evaluator: Optional[HeldOutEvaluation] = None,
                 eval_timeout: float = 600.0, rewards: Optional[RewardExecutor] = None) -> None:
        """`rewards`: the reward executor of every episode it runs (a workflow built with one
        of its own uses that); without it, one of the controller's own, default settings."""
        self.config = config
        self.engine = engine
        self._owns_rewards = rewards is None
        self.rewards = rewards if rewards is not None else RewardExecutor()
        self.executor = WorkflowExecutor(config, engine, wait_timeout=wait_timeout,
                                         rewards=self.rewards)
        self.evaluator = evaluator
        self.eval_timeout = eval_timeout
        self._held: set[concurrent.futures.Future[Any]] = set()
        self._evaluations: list[tuple[int, concurrent.futures.Future[dict[str, float]]]] = []

    # ---- lifecycle ----------------------------------------------------------------------
    def initialize(self, loop_thread: Optional[Any] = None, check_health: bool = True) -> None:
        """Start the rollout loop and connect the engine on it (the loop is the executor's:
        `loop_thread` must be None)."""
        if loop_thread is not None:
            raise ValueError("RolloutController runs its engine on its executor's loop; "
                             "initialize(loop_thread=...) is for engines")
        self.executor.initialize()
        try:
            self.engine.watch_fleet(self.executor.fail)
            self.engine.initialize(loop_thread=self.executor.loop_thread,
                                   check_health=check_health)
        except BaseException:
            self.executor.destroy()
            raise

    def destroy(self) -> None:
        """Close the engine's session, then stop the loop. Safe to call twice."""
        try:
            self.engine.destroy()
        finally:
            self.executor.destroy()
            if self._owns_rewards:
                self.rewards.shutdown()

    def run_coroutine(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run `coro` on the rollout loop from another thread (TimeoutError after `timeout`);
        the episodes it runs get the controller's reward executor."""
        return self.executor.run_coroutine(with_episode_rewards(self.rewards, coro), timeout)

    # ---- generation ---------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return await self.engine.agenerate(req)

    async def agenerate_n(self, req: ModelRequest) -> list[ModelResponse]:
        return await self.engine.agenerate_n(req)

    # ---- rollouts (the executor) --------------------------------------------------------
    @property
    def keep_partial_groups(self) -> bool:
        return self.executor.keep_partial_groups

    @keep_partial_groups.setter
    def keep_partial_groups(self, keep: bool) -> None:
        # a group missing a failed sample gives a wrong baseline to group statistics
        self.executor.keep_partial_groups = keep

    def submit(self, data: dict[str, Any], workflow: RolloutWorkflow,
               should_accept: Optional[ShouldAccept] = None) -> None:
        self.executor.submit(data, workflow, should_accept)

    def wait(self, count: int, timeout: Optional[float] = None) -> TensorDict:
        return self.executor.wait(count, timeout)

    def rollout_batch(self, data: list[dict[str, Any]], workflow: RolloutWorkflow,
                      should_accept: Optional[ShouldAccept] = None,
                      timeout: Optional[float] = None) -> TensorDict:
        return self.executor.rollout_batch(data, workflow, should_accept, timeout)

    def prepare_batch(self, dataloader: Iterable[Any], workflow: RolloutWorkflow,
                      should_accept: Optional[ShouldAccept] = None,
                      timeout: Optional[float] = None) -> TensorDict:
        return self.executor.prepare_batch(dataloader, workflow, should_accept, timeout)

    @property
    def last_episode_ids(self) -> list[str]:
        """Episode ids (`data_id@episode_seed`) of the last batch returned."""
        return list(self.executor.last_episode_ids)

    def buffered_episode_ids(self) -> list[str]:
        return self.executor.buffered_episode_ids()

    def episode_seed(self, data: dict[str, Any]) -> int:
        return self.executor.episode_seed(data)

    def stats(self) -> dict[str, Any]:
        return self.executor.stats()

    def fleet_stats(self) -> dict[str, float]:
        return self.engine.fleet_stats()

    def export_stats(self) -> dict[str, float]:
        return {**self.fleet_stats(), **stats_tracker.export()}

    def state_dict(self) -> dict[str, Any]:
        return self.executor.state_dict()

    def load_state_dict(self, state: dict[str, Any], restore_version: bool = True) -> None:
        self.executor.load_state_dict(state, restore_version)

    # ---- versions and weights -----------------------------------------------------------
    def pause(self) -> None:
        """Stop admitting episodes, then pause the servers (in-flight requests are kept)."""
        self.executor.pause()
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()
        self.executor.resume()

    def run_at_version(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Start `coro` on the rollout loop now; the next weight update waits until it is done,
        so every request it makes is served by the current weights."""
        future = asyncio.run_coroutine_threadsafe(with_episode_rewards(self.rewards, coro),
                                                  self.executor.loop)
        self._held.add(future)
        future.add_done_callback(self._held.discard)
        return future

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Wait for the work started with `run_at_version` (within
        `rollout.weights.update_timeout`), then load `meta` on the fleet."""
        self._wait_for_pinned(meta.version)
        self.engine.update_weights(meta)

    # an update trainer rank 0 drives: the same wait before the fleet pauses, then the engine's
    def begin_weight_update(self, version: int, pause_mode: str) -> FleetView:
        self._wait_for_pinned(version)
        return self.engine.begin_weight_update(version, pause_mode)

    def end_weight_update(self, report: UpdateReport) -> None:
        self.engine.end_weight_update(report)

    def _wait_for_pinned(self, version: int) -> None:
        deadline = time.monotonic() + self.config.weights.update_timeout
        for future in list(self._held):
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"a task pinned to version {self.get_version()} (e.g. an evaluation) did "
                    f"not finish within rollout.weights.update_timeout="
                    f"{self.config.weights.update_timeout} s; weights v{version} not loaded"
                ) from None
            except Exception:
                pass  # its owner reads the error from its future; the update may go on

    def set_version(self, version: int) -> None:
        self.engine.set_version(version)

    def get_version(self) -> int:
        return self.engine.get_version()

    # ---- held-out evaluation ------------------------------------------------------------
    def start_evaluation(self, version: int) -> None:
        """See `RolloutAPI.start_evaluation`; without an evaluator, nothing to do."""
        if self.evaluator is None:
            return
        seeds = self.evaluator.draw_seeds(self)  # now, in call order: runs repeat exactly
        future = self.run_at_version(self.evaluator.arun(self.engine, seeds))
        self._evaluations.append((version, future))
        if self.config.staleness.max_head_offpolicyness == 0:
            # eta = 0 is the synchronous reference and repeats bit for bit: nothing it
            # trains on may share the servers with evaluation requests (see docs)
            done, _ = concurrent.futures.wait([future], timeout=self.eval_timeout)
            if not done:  # training must not go on beside it: that is no longer eta = 0
                self._evaluations.pop()
                raise self._overran(version, future)

    def finished_evaluations(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        deadline = time.monotonic() + self.eval_timeout
        done = []
        while self._evaluations:
            version, future = self._evaluations[0]
            if not future.done() and not wait:
                break
            try:
                metrics = future.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise self._overran(version, future) from None
            self._evaluations.pop(0)
            done.append((version, metrics))
        return done

    def _overran(self, version: int, future: concurrent.futures.Future[Any]) -> TimeoutError:
        future.cancel()
        return TimeoutError(f"evaluation of version {version} did not finish within "
                            f"{self.eval_timeout:.0f} s")
