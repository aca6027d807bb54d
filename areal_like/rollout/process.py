"""The rollout controller in a process of its own, and the trainer's handle on it.

Why a process: the executor's event loop, tokenization, reward calls and batching are Python
work; run as a thread of the trainer they take its interpreter lock and slow every training
step that overlaps them. Here they run in a child process (spawned: no fork of a process that
holds torch threads and sockets) that owns the fleet client, the `WorkflowExecutor`, the
reward workers and held-out evaluation. The trainer (rank 0) talks to it through
`RolloutProcess`, which offers the rollout API (`RolloutAPI`) as `RolloutController` does.

The channel is a `multiprocessing` pipe, one call at a time. Batches come back as
TensorDicts whose tensors travel through shared memory (torch's multiprocessing reductions:
a file descriptor per storage, no copy of the data through the pipe). Workflows, dataloaders
and `should_accept` functions are sent once (by reference afterwards), so they must be
picklable; a workflow built without a reward executor scores with the controller's (built
from the set-up's `reward` section, see `UsesRewards`). Every call is
bounded by a timeout; a controller that dies or stops answering fails the call with its exit
code, and a failed call inside the controller is re-raised here as the same exception type
with the controller's traceback attached as a note.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import inspect
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch.multiprocessing  # noqa: F401  (registers shared-memory reductions for tensors)

from areal_like.api.rollout_api import RolloutAPI, remote_calls
from areal_like.rollout.service import RolloutProcessError, RolloutSetup, _Ref, serve
from areal_like.utils.spawn_main import children_skip_the_program

logger = logging.getLogger(__name__)
CALL_MARGIN_S = 60.0  # on top of a call's own timeout: the controller enforces that one
EXIT_TIMEOUT_S = 10.0  # a trainer that ends with an exception waits this long for it to stop


class RolloutProcess(RolloutAPI):
    """Trainer-side handle of a controller process (see module doc)."""

    def __init__(self, setup: Optional[RolloutSetup] = None) -> None:
        """`setup` now, or later: `start(setup)`."""
        self.setup = setup
        self._last_episode_ids: list[str] = []
        self._process: Optional[mp.process.BaseProcess] = None
        self._conn: Any = None
        self._sent: dict[int, tuple[int, Any]] = {}  # id(obj) -> (token, obj: kept alive)
        self._unsent: dict[int, tuple[int, Any]] = {}
        self._tokens = itertools.count()
        self._broken: Optional[str] = None
        self._owed_s = 0.0  # the bounds of one-way calls sent since the last reply
        self._calling = threading.Lock()  # one call at a time, from any thread (see `_call`)

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    # ---- lifecycle ----------------------------------------------------------------------
    def initialize(self) -> None:
        """Start the controller; returns once it reached every server (or raises its error)."""
        self.start()
        self.wait_ready()

    def spawn(self, nice: int = 0, cpus: Sequence[int] = ()) -> None:
        """Start the controller process before its set-up is known: it imports (seconds) and
        places itself (`rollout.controller.nice`, `rollout.controller.cpus`) while the trainer
        loads its data and engine; `start(setup)` hands it the set-up. Call it from the thread
        that lives as long as the run (the main thread): the controller stops when that thread
        ends (it watches its parent)."""
        if self._process is not None:
            return
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        with children_skip_the_program() as program:  # imported there only if it needs it
            self._process = ctx.Process(target=serve,
                                        args=(child_conn, nice, list(cpus), program),
                                        name="rollout-controller", daemon=False)
            self._process.start()
        child_conn.close()
        # an exception that ends the trainer must end the controller too: multiprocessing's
        # own exit hook would otherwise wait for it forever (it waits for the trainer)
        atexit.register(self.destroy, timeout=EXIT_TIMEOUT_S)

    def start(self, setup: Optional[RolloutSetup] = None) -> None:
        """Send the controller its set-up (`setup`, or the one given at construction),
        spawning it first unless `spawn` did; `wait_ready` then waits until it is built."""
        self.setup = setup or self.setup
        if self.setup is None:
            raise ValueError("RolloutProcess.start: no set-up (RolloutProcess(setup) or "
                             "start(setup))")
        try:
            setup_bytes = pickle.dumps(self.setup)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"the rollout controller's set-up (workflows, evaluation data, "
                            f"reward functions) cannot be pickled: {e}") from e
        self.spawn(self.setup.rollout.controller.nice, self.setup.rollout.controller.cpus)
        # it may have ended already (e.g. could not pin itself): `wait_ready` reports why
        with contextlib.suppress(OSError, EOFError):
            self._conn.send_bytes(setup_bytes)

    def wait_ready(self) -> None:
        """Wait until the started controller reached every server (or raise its error)."""
        assert self.setup is not None, "start() first"
        try:
            self._receive("start-up", self.setup.rollout.client.setup_timeout + CALL_MARGIN_S)
        except BaseException:
            self.destroy()
            raise

    def destroy(self, timeout: float = 60.0) -> None:
        """Ask the controller to shut down (it stops its servers' client, reward workers and
        loop), then reap it; kill it if it does not exit within `timeout` s."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.destroy)
        try:
            if self._broken is None and process.is_alive():
                self._conn.send(None)
        except (OSError, EOFError):
            pass  # already gone: reaped below
        process.join(timeout)
        if process.is_alive():
            logger.error("rollout controller (pid %d) did not exit within %.0f s; killing it",
                         process.pid, timeout)
            process.kill()
            process.join(10)
        self._conn.close()

    # ---- the call -----------------------------------------------------------------------
    def _ref(self, obj: Any) -> Any:
        if obj is None:
            return None
        known = self._sent.get(id(obj))
        if known is not None:
            return _Ref(known[0])
        token = next(self._tokens)
        self._unsent[id(obj)] = (token, obj)  # known to the controller once the call is sent
        return _Ref(token, obj)

    def _call(self, name: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        # the trainer's main thread, and its weight updater asking for a hold while the main
        # thread exports (`FleetUpdater.hold_ahead`): each call's send and reply stay together
        with self._calling:
            return self._call_now(name, *args, timeout=timeout, **kwargs)

    def _call_now(self, name: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        one_way = name in ONE_WAY_CALLS
        if self._broken is not None:
            raise RolloutProcessError(f"rollout controller unusable: {self._broken}")
        if self._process is None:
            raise RolloutProcessError("RolloutProcess is not initialized: call initialize()")
        unsent, self._unsent = self._unsent, {}
        try:
            self._conn.send((name, args, kwargs, one_way))  # pickled whole before a byte is written
            self._sent.update(unsent)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"{name}: could not send the call to the rollout controller process ({e}); "
                f"workflows, dataloaders, data items and should_accept functions must be "
                f"picklable (module-level functions and classes, no lambdas or open handles)"
            ) from e
        except (OSError, EOFError) as e:
            raise self._died(name, e) from e
        if one_way:  # answered in order before the next call, which raises its error
            self._owed_s += timeout
            return None
        owed, self._owed_s = self._owed_s, 0.0
        value, self._last_episode_ids = self._receive(name, timeout + owed + CALL_MARGIN_S)
        return value

    def _receive(self, name: str, timeout: float) -> Any:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise self._died(name, None)
            if time.monotonic() > deadline:
                self._broken = f"{name} got no answer within {timeout:.0f} s"
                raise RolloutProcessError(
                    f"rollout controller (pid {self._process.pid}) did not answer {name} "
                    f"within {timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except (OSError, EOFError) as e:
            raise self._died(name, e) from e
        if kind == "error":
            raise value
        return value

    def _died(self, name: str, cause: Optional[BaseException]) -> RolloutProcessError:
        assert self._process is not None
        self._process.join(5)
        code = self._process.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}")
        self._broken = f"the process died ({how})"
        return RolloutProcessError(
            f"rollout controller process (pid {self._process.pid}) died during {name} ({how}"
            + (f"; {type(cause).__name__}: {cause}" if cause else "") + "); its log lines are "
            "above, in the trainer's output")

    # ---- the rollout API: every call derived from its declaration (see the end) ---------
    @property
    def last_episode_ids(self) -> list[str]:
        return list(self._last_episode_ids)


# The bound on each call the trainer makes, by name (seconds, before CALL_MARGIN_S), from the
# set-up and the call's arguments; a call not named here gets DEFAULT_CALL_TIMEOUT_S.
DEFAULT_CALL_TIMEOUT_S = 60.0
CallTimeout = Callable[[RolloutSetup, dict[str, Any]], float]


def _batch_timeout(setup: RolloutSetup, args: dict[str, Any]) -> float:
    return setup.wait_timeout if args.get("timeout") is None else args["timeout"]


def _weight_timeout(setup: RolloutSetup, args: dict[str, Any]) -> float:
    return setup.rollout.weights.update_timeout


CALL_TIMEOUTS: dict[str, CallTimeout] = {
    "wait": _batch_timeout,
    "rollout_batch": _batch_timeout,
    "prepare_batch": _batch_timeout,
    "update_weights": lambda setup, args: 3 * _weight_timeout(setup, args),
    # pinned work finishes, then the fleet is held (the trainer then loads over HTTP itself)
    "begin_weight_update": lambda setup, args: 2 * _weight_timeout(setup, args),
    "end_weight_update": _weight_timeout,
    "start_evaluation": lambda setup, args: setup.eval_timeout,
    "finished_evaluations": lambda setup, args: (setup.eval_timeout if args.get("wait")
                                                 else DEFAULT_CALL_TIMEOUT_S),
}
# Calls whose reply carries nothing for the trainer: sent without waiting for it (one pipe
# round trip less per weight update, on the trainer's critical path). The controller answers
# calls in the order sent, so the next call sees their effect; an error of theirs is raised
# by the next call, which then does not run.
ONE_WAY_CALLS = frozenset({"end_weight_update"})
# arguments sent once and by reference afterwards (the controller keeps them)
BY_REFERENCE = frozenset({"workflow", "dataloader", "should_accept"})


def _remote_call(name: str, declared: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(declared)
    timeout = CALL_TIMEOUTS.get(name, lambda setup, args: DEFAULT_CALL_TIMEOUT_S)

    def call(self: RolloutProcess, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()  # every argument travels, positionally
        given = dict(bound.arguments)
        for key in BY_REFERENCE & given.keys():
            bound.arguments[key] = self._ref(given[key])
        assert self.setup is not None
        return self._call(name, *bound.args[1:], timeout=timeout(self.setup, given),
                          **bound.kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = declared.__doc__
    call.__signature__ = signature  # type: ignore[attr-defined]  # for help() and inspect
    return call


for _name, _declared in remote_calls().items():
    setattr(RolloutProcess, _name, _remote_call(_name, _declared))
abc.update_abstractmethods(RolloutProcess)  # type: ignore[type-abstract]  # concrete now
