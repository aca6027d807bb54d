"""Resume a killed run exactly where its last checkpoint left it."""

from __future__ import annotations

import logging
from typing import Any, Optional

from areal_like.api import TrainEngine
from areal_like.rollout.process import RolloutProcess
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.context import RunContext
from areal_like.runtime.weight_sync import WeightLoader, WeightPusher, push_weights
from areal_like.utils.launcher_state import trainer_attempt

logger = logging.getLogger(__name__)


def save_checkpoint(ckpt: Checkpointer, step: int, engine: TrainEngine,
                    rollout: Optional[RolloutProcess],
                    stateful: Optional[dict[str, Any]] = None) -> None:
    """Train state on every rank; executor state (data position, buffered trajectories,
    counters) and `stateful` objects' `state_dict()` (e.g. an actor's KL coefficient, the
    same on every rank) from rank 0."""
    state: dict[str, Any] = {"executor": rollout.state_dict() if rollout else None}
    state["objects"] = {name: obj.state_dict() for name, obj in (stateful or {}).items()}
    ckpt.save(step, engine, state)


def maybe_recover(ckpt: Checkpointer, run: RunContext, engine: TrainEngine,
                  rollout: Optional[RolloutProcess], fleet: Optional[WeightLoader] = None,
                  broadcaster: Optional[WeightPusher] = None,
                  stateful: Optional[dict[str, Any]] = None,
                  in_memory: bool = False) -> int:
    """The step to start from: 0 for a fresh run, saved step + 1 after a recover.

    On recover the engine gets its weights, optimizer, scheduler, RNG and version back, the
    executor its data position and buffered trajectories, and the fleet the saved weights
    (loaded by rank 0's `fleet`).
    """
    if run.config.checkpoint.recover != "auto":
        return 0
    path = ckpt.latest()
    if path is None:
        if trainer_attempt() > 0:  # restarted before any checkpoint: the fleet holds weights
            # of the dead trainer's steps; it must serve the start's weights as version 0
            push_weights(engine, fleet, engine.get_version(), run.weights_dir,
                         collective_timeout_s=run.config.actor.collective_timeout,
                         broadcaster=broadcaster, in_memory=in_memory)
        return 0
    state = ckpt.load(path, engine)
    version = engine.get_version()
    saved = state.get("objects", {})
    for name, obj in (stateful or {}).items():
        if name not in saved:
            raise KeyError(f"checkpoint {path} has no state for {name!r} (saved: "
                           f"{sorted(saved)}); it was written by a run that did not track it")
        obj.load_state_dict(saved[name])
    if rollout is not None and state.get("executor") is not None:
        rollout.load_state_dict(state["executor"], restore_version=False)
    push_weights(engine, fleet, version, run.weights_dir,
                 collective_timeout_s=run.config.actor.collective_timeout,
                 broadcaster=broadcaster, in_memory=in_memory)
    logger.info("recovered from %s: step %d, version %d", path, state["step"], version)
    return int(state["step"]) + 1
