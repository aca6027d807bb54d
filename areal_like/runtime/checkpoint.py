"""Checkpoints for exact resume: train state (DCP), executor state and the run's own state.

Layout: `<dir>/step<N>/{train_state/, run_state.pt}` and `<dir>/latest` naming the newest
complete one (written last, atomically, so a run killed mid-save resumes from the previous).
With `checkpoint.async_save` the train state is written beside the next steps: the checkpoint
is committed (run state, `latest`) once every rank's write finished: the first step end that
finds it written (`commit_if_written`), else the next save or the run's end (`commit`).
"""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from areal_like.api import SaveLoadMeta, TrainEngine
from areal_like.api.config import CheckpointConfig
from areal_like.utils.atomic_file import write_atomic


class Checkpointer:
    def __init__(self, config: CheckpointConfig, run_dir: Path, rank: int = 0) -> None:
        self.config = config
        self.dir = Path(config.save_dir) if config.save_dir else Path(run_dir) / "checkpoints"
        self.rank = rank
        # (checkpoint, its run state serialised when saved): being written, not yet committed
        self._pending: Optional[tuple[Path, bytes]] = None

    def should_save(self, step: int, last_step: bool = False) -> bool:
        freq = self.config.freq_steps
        return freq > 0 and ((step + 1) % freq == 0 or last_step)

    def save(self, step: int, engine: TrainEngine, run_state: dict[str, Any]) -> Path:
        """Every rank calls this; rank 0's `run_state` (executor state etc.) is written."""
        self.commit(engine)  # the previous checkpoint, if its write was still going on
        path = self.dir / f"step{step}"
        state = io.BytesIO()  # now: the objects it holds go on changing with the run
        if self.rank == 0:
            torch.save({"step": step, "python_rng": random.getstate(),
                        "numpy_rng": np.random.get_state(), **run_state}, state)
        engine.save(SaveLoadMeta(str(path / "train_state"), weight_format="dcp", with_optim=True,
                                 async_save=self.config.async_save))
        self._pending = (path, state.getvalue())
        if not self.config.async_save:
            self.commit(engine)
        return path

    def commit(self, engine: TrainEngine) -> None:
        """Collective: once the pending checkpoint's train state is written on every rank,
        rank 0 writes its run state and names it `latest`."""
        if self._pending is None:
            return
        engine.wait_for_saves()
        (path, state), self._pending = self._pending, None
        if self.rank == 0:
            (path / "run_state.pt").write_bytes(state)  # (named by `latest` only next)
            write_atomic(self.dir / "latest", path.name)
            self._prune(keep=self.config.keep_last)
        if dist.is_initialized():
            dist.barrier()

    def commit_if_written(self, engine: TrainEngine) -> None:
        """Collective: commit the pending checkpoint if every rank has written it (called at
        every step's end: a run killed later resumes from it)."""
        if self._pending is not None and engine.saves_written():
            self.commit(engine)

    def _prune(self, keep: int) -> None:
        steps = sorted((int(p.name[4:]), p) for p in self.dir.glob("step*") if p.name[4:].isdigit())
        for _, p in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> Optional[Path]:
        marker = self.dir / "latest"
        if not marker.is_file():
            return None
        path = self.dir / marker.read_text().strip()
        if not (path / "run_state.pt").is_file():
            raise FileNotFoundError(f"checkpoint marker {marker} names {path}, which is incomplete")
        return path

    def load(self, path: Path, engine: TrainEngine) -> dict[str, Any]:
        """Restore `engine` (weights, optimizer, scheduler, RNG, version) and the RNGs of this
        process; return the saved run state."""
        engine.load(SaveLoadMeta(str(path / "train_state"), weight_format="dcp", with_optim=True))
        state = torch.load(path / "run_state.pt", weights_only=False)
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        return state
