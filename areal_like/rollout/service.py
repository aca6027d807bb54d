"""What runs inside the rollout controller process (see `process.py`): the fleet
client, the `RolloutController`, the reward workers, and held-out evaluations that run beside
training rollouts, pinned to the version they evaluate."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch

from areal_like.api.config import RewardConfig, RolloutConfig
from areal_like.api.rollout_api import remote_calls
from areal_like.rewards.failures import RewardFunctionError
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.rollout.controller import RolloutController
from areal_like.rollout.evaluation import Evaluator
from areal_like.utils.cpus import pin_to_cpus
from areal_like.utils.quiet import silence_library_progress_bars
from areal_like.utils.spawn_main import ParentProgram, import_program_on_first_use
from engines import RemoteInferenceEngine

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


class RolloutService:
    """The controller process's side of the pipe: the `RolloutController` built from the
    set-up, answering the calls `remote_calls()` derives from the rollout API."""

    CALLS = frozenset(remote_calls())

    def __init__(self, setup: RolloutSetup) -> None:
        silence_library_progress_bars()
        self.setup = setup
        self.rewards = RewardExecutor(setup.reward)  # every episode's (the controller's)
        self.controller: Optional[RolloutController] = None
        self._objects: dict[int, Any] = {}
        try:
            for what, reward_fn, example in setup.reward_checks:
                try:
                    self.rewards.check(reward_fn, example, load_in_worker=True)
                except RewardFunctionError as e:
                    raise RewardFunctionError(f"{what}: {e}") from None
            controller = RolloutController(setup.rollout, RemoteInferenceEngine(setup.rollout),
                                           wait_timeout=setup.wait_timeout,
                                           evaluator=setup.evaluator,
                                           eval_timeout=setup.eval_timeout,
                                           rewards=self.rewards)
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
        if name not in self.CALLS:
            raise AttributeError(f"the rollout controller has no call {name!r}")
        assert self.controller is not None
        args = tuple(self._resolve(a) for a in args)
        kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
        return getattr(self.controller, name)(*args, **kwargs)

    def last_episode_ids(self) -> list[str]:
        assert self.controller is not None
        return self.controller.last_episode_ids

    def _resolve(self, value: Any) -> Any:
        if not isinstance(value, _Ref):
            return value
        if value.obj is not None:
            self._objects[value.token] = value.obj
        return self._objects[value.token]


def serve(conn: Any, nice: int, cpus: list[int],
          program: Optional[ParentProgram] = None) -> None:
    """The controller process: place itself (`nice`, `cpus`), wait for its set-up, build the
    service, then answer calls until told to stop or until the trainer's end of the pipe
    closes (the trainer died). It is started before the trainer knows the set-up, so that its
    imports overlap the trainer's own start-up (`RolloutProcess.spawn`). The set-up arrives
    pickled; the service builds the reward executor every episode gets from it. `program`: the
    trainer's, imported here only when something sent names an object it defines."""
    if program is not None:
        import_program_on_first_use(program)
    _stop_with_parent()
    if nice:  # before the reward workers start: they inherit it
        os.nice(nice)
    try:
        pin_to_cpus("rollout.controller.cpus", cpus)
    except ValueError as e:
        conn.send(("error", _portable(e)))
        return
    try:
        setup_bytes = conn.recv_bytes()
    except (EOFError, OSError):
        return  # the trainer ended before it had a set-up to send
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s [rollout-controller] %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        setup: Optional[RolloutSetup] = pickle.loads(setup_bytes)
        if setup is None:  # stopped before its set-up
            return
        service = RolloutService(setup)
    except BaseException as e:
        conn.send(("error", _portable(e)))
        return
    unreported: Optional[BaseException] = None  # the error of a one-way call, sent next
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
            name, args, kwargs, one_way = message
            error: Optional[BaseException] = unreported  # a one-way call's: answers this one
            unreported = None
            if error is None:
                try:
                    value = (service.call(name, args, kwargs), service.last_episode_ids())
                except BaseException as e:  # noqa: BLE001  (sent to the trainer, re-raised there)
                    error = _portable(e, one_way_call=name if one_way else None)
            if one_way:
                if error is not None:
                    logger.error("%s failed; the trainer's next call raises it: %s", name, error)
                unreported = error
            elif error is not None:
                conn.send(("error", error))
            else:
                conn.send(("ok", value))
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


def _portable(exc: BaseException, one_way_call: Optional[str] = None) -> BaseException:
    """`exc` with the controller's traceback as a note, or a RolloutProcessError carrying its
    text when the exception type cannot be rebuilt in the trainer. `one_way_call`: the call
    that failed was sent without waiting; its error answers the trainer's next call."""
    text = "".join(traceback.format_exception(exc))
    if one_way_call is not None:
        text = (f"raised by {one_way_call}, sent before this call without waiting for its "
                f"answer; this call did not run\n{text}")
    try:
        exc.add_note(f"in the rollout controller process:\n{text}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001  (not picklable: send its text instead)
        return RolloutProcessError(f"{type(exc).__name__}: {exc}\n"
                                   f"in the rollout controller process:\n{text}")
