"""What runs inside the rollout controller process (see `rollout_process.py`): the fleet
client, the `RolloutController`, the reward workers, and held-out evaluations that run beside
training rollouts, pinned to the version they evaluate."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch

from areal_like.api.config import RewardConfig, RolloutConfig
from areal_like.rewards.failures import RewardFunctionError
from areal_like.rewards.reward_executor import configure_rewards, default_reward_executor
from areal_like.rollout.controller import RolloutController
from areal_like.runtime.evaluation import Evaluator
from areal_like.utils import stats_tracker
from areal_like.utils.cpus import pin_to_cpus
from areal_like.utils.quiet import silence_library_progress_bars
from engines import RemoteSGLangEngine

logger = logging.getLogger(__name__)


class RolloutProcessError(RuntimeError):
    """The rollout controller process died, stopped answering, or could not be reached."""


@dataclasses.dataclass
class RolloutSetup:
    """Everything the controller process is built from (sent once, at start)."""

    rollout: RolloutConfig
    reward: RewardConfig
    keep_partial_groups: bool = False
    # (what, reward_fn, example item): checked in the controller, where the rewards run
    reward_checks: list[tuple[str, Callable[..., Any], Optional[dict[str, Any]]]] = (
        dataclasses.field(default_factory=list))
    evaluator: Optional[Evaluator] = None
    eval_timeout: float = 600.0
    wait_timeout: float = 3600.0


@dataclasses.dataclass
class _Ref:
    """An object sent once: `obj` is set the first time only."""

    token: int
    obj: Any = None


# the calls the trainer may make (anything else is a bug on its side): answered by the
# `RolloutController` as they are, or by the service where it adds something
CONTROLLER_CALLS = frozenset({
    "submit", "pause", "resume", "update_weights", "set_version", "get_version",
    "state_dict", "load_state_dict", "buffered_episode_ids", "stats",
    "form_weight_group", "join_weight_group", "begin_weight_broadcast",
    "receive_weight_bucket", "end_weight_broadcast",
})
SERVICE_CALLS = frozenset({
    "wait", "rollout_batch", "prepare_batch", "export_stats", "start_evaluation",
    "finished_evaluations",
})


class RolloutService:
    def __init__(self, setup: RolloutSetup) -> None:
        silence_library_progress_bars()
        self.setup = setup
        self.rewards = default_reward_executor()  # configured by `serve` (see there)
        self.controller: Optional[RolloutController] = None
        self._objects: dict[int, Any] = {}
        self._evaluations: list[tuple[int, concurrent.futures.Future[dict[str, float]]]] = []
        try:
            for what, reward_fn, example in setup.reward_checks:
                try:
                    self.rewards.check(reward_fn, example, load_in_worker=True)
                except RewardFunctionError as e:
                    raise RewardFunctionError(f"{what}: {e}") from None
            controller = RolloutController(setup.rollout, RemoteSGLangEngine(setup.rollout),
                                           wait_timeout=setup.wait_timeout)
            controller.keep_partial_groups = setup.keep_partial_groups
            controller.initialize()
            self.controller = controller
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.controller is not None:
                self.controller.destroy()
        finally:
            self.rewards.shutdown()

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name not in CONTROLLER_CALLS | SERVICE_CALLS:
            raise AttributeError(f"the rollout controller has no call {name!r}")
        args = tuple(self._resolve(a) for a in args)
        target = self.ctl if name in CONTROLLER_CALLS else self
        return getattr(target, name)(*args, **kwargs)

    def _resolve(self, value: Any) -> Any:
        if not isinstance(value, _Ref):
            return value
        if value.obj is not None:
            self._objects[value.token] = value.obj
        return self._objects[value.token]

    @property
    def ctl(self) -> RolloutController:
        assert self.controller is not None
        return self.controller

    # ---- batches (with the episode ids of the batch) -----------------------------------
    def wait(self, count: int, wait_s: Optional[float]) -> tuple[Any, list[str]]:
        return self.ctl.wait(count, wait_s), self.ctl.last_episode_ids

    def rollout_batch(self, data: list[dict[str, Any]], workflow: Any, should_accept: Any,
                      wait_s: Optional[float]) -> tuple[Any, list[str]]:
        return (self.ctl.rollout_batch(data, workflow, should_accept, wait_s),
                self.ctl.last_episode_ids)

    def prepare_batch(self, loader: Any, workflow: Any, should_accept: Any,
                      wait_s: Optional[float]) -> tuple[Any, list[str]]:
        return (self.ctl.prepare_batch(loader, workflow, should_accept, wait_s),
                self.ctl.last_episode_ids)

    def export_stats(self) -> dict[str, float]:
        return {**self.ctl.fleet_stats(), **stats_tracker.export()}

    # ---- evaluation ---------------------------------------------------------------------
    def start_evaluation(self, version: int) -> None:
        evaluator = self.setup.evaluator
        if evaluator is None:
            return
        seeds = evaluator.draw_seeds(self.ctl)  # now, in call order: runs repeat exactly
        future = self.ctl.run_at_version(evaluator.arun(self.ctl.engine, seeds))
        self._evaluations.append((version, future))
        if self.setup.rollout.max_head_offpolicyness == 0:
            # eta = 0 is the synchronous reference and repeats bit for bit: nothing it
            # trains on may share the servers with evaluation requests (see docs)
            done, _ = concurrent.futures.wait([future], timeout=self.setup.eval_timeout)
            if not done:  # training must not go on beside it: that is no longer eta = 0
                self._evaluations.pop()
                raise self._overran(version, future)

    def finished_evaluations(self, wait: bool) -> list[tuple[int, dict[str, float]]]:
        deadline = time.monotonic() + self.setup.eval_timeout
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
                            f"{self.setup.eval_timeout:.0f} s")


def serve(conn: Any, nice: int, cpus: list[int]) -> None:
    """The controller process: place itself (`nice`, `cpus`), wait for its set-up, build the
    service, then answer calls until told to stop or until the trainer's end of the pipe
    closes (the trainer died). It is started before the trainer knows the set-up, so that its
    imports overlap the trainer's own start-up (`RolloutProcess.spawn`).

    The setup arrives as (reward config, pickled setup) and is unpickled only after the shared
    reward executor is configured: the workflows in it then take that executor (see
    `RewardExecutor.__reduce__`)."""
    _stop_with_parent()
    if nice:  # before the reward workers start: they inherit it
        os.nice(nice)
    try:
        pin_to_cpus("rollout.controller_cpus", cpus)
    except ValueError as e:
        conn.send(("error", _portable(e)))
        return
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return  # the trainer ended before it had a set-up to send
    if message is None:
        return
    reward, setup_bytes = message
    configure_rewards(reward)
    setup: RolloutSetup = pickle.loads(setup_bytes)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s [rollout-controller] %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        service = RolloutService(setup)
    except BaseException as e:
        conn.send(("error", _portable(e)))
        return
    try:
        conn.send(("ok", None))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                logger.error("the trainer closed the pipe (it died?): shutting down")
                return
            if message is None:
                return
            name, args, kwargs = message
            try:
                reply = ("ok", service.call(name, args, kwargs))
            except BaseException as e:  # noqa: BLE001  (sent to the trainer, re-raised there)
                reply = ("error", _portable(e))
            conn.send(reply)
    finally:
        service.close()


def _stop_with_parent() -> None:
    """SIGTERM when the trainer dies, even mid-call (Linux); it unwinds through `finally`, so
    the reward workers stop too and nothing keeps generating for a dead run."""
    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"rollout controller: signal {signum} (the trainer exited)")

    signal.signal(signal.SIGTERM, on_term)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            raise SystemExit("rollout controller: the trainer exited during start-up")


def _portable(exc: BaseException) -> BaseException:
    """`exc` with the controller's traceback as a note, or a RolloutProcessError carrying its
    text when the exception type cannot be rebuilt in the trainer."""
    text = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"in the rollout controller process:\n{text}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001  (not picklable: send its text instead)
        return RolloutProcessError(f"{type(exc).__name__}: {exc}\n"
                                   f"in the rollout controller process:\n{text}")
