"""AReaL-lite's training-script helpers on ours: the PPO actor as an engine, the stats
logger, the saver and the evaluator timers, seeding."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.api import FinetuneSpec, SaveLoadMeta
from areal_like.api import WeightUpdateMeta as _WeightUpdateMeta
from areal_like.api.algorithm_config import AlgorithmConfig
from areal_like.api.config import (
    CheckpointConfig,
    EvaluationConfig,
    LoggingConfig,
    TrainEngineConfig,
)
from areal_like.api.seeding import derive_seed
from areal_like.api.tracker_config import WandbConfig
from areal_like.arealite.config import (
    EvaluatorConfig,
    PPOActorConfig,
    SaverConfig,
    StatsLoggerConfig,
)
from areal_like.arealite.engines import FSDPEngine
from areal_like.utils import stats_tracker
from areal_like.utils.metrics_logger import MetricsLogger, run_dir

logger = logging.getLogger("areal_like")


class FSDPPPOActor(FSDPEngine):
    """AReaL-lite's PPO actor: our FSDP engine with a `PPOActor`. The PPO settings come from
    `algorithm` when given, else from the actor section itself, where AReaL-lite keeps them
    (`areal_like.arealite.PPOActorConfig`)."""

    def __init__(self, config: TrainEngineConfig,
                 algorithm: Optional[AlgorithmConfig] = None) -> None:
        super().__init__(config)
        if algorithm is None:
            algorithm = (config.algorithm() if isinstance(config, PPOActorConfig)
                         else AlgorithmConfig())
        self.actor = PPOActor(self, algorithm)

    def compute_logp(self, batch: TensorDict) -> torch.Tensor:
        return self.actor.compute_logp(batch)

    def compute_advantages(self, batch: TensorDict) -> TensorDict:
        """In place, as in AReaL-lite: `batch` gains `advantages` (and is next-token aligned)."""
        batch.update(self.actor.compute_advantages(batch))
        return batch

    def ppo_update(self, batch: TensorDict) -> list[dict[str, float]]:
        return [self.actor.update(batch)]


class _Timer:
    """Due every `freq_steps` global steps, at the end of every `freq_epochs`-th epoch, or
    `freq_secs` after it was last due, whichever comes first (AReaL-lite's rule; our own
    sections have `freq_steps` only, 0 or None: off)."""

    def __init__(self, config: Any, ft_spec: FinetuneSpec) -> None:
        self.freq_steps = getattr(config, "freq_steps", None)
        self.freq_epochs = getattr(config, "freq_epochs", None)
        self.freq_secs = getattr(config, "freq_secs", None)
        self.steps_per_epoch = ft_spec.steps_per_epoch
        self._last = time.monotonic()

    def due(self, epoch: int, step: int, global_step: int) -> bool:
        now = time.monotonic()
        hit = bool(self.freq_steps and (global_step + 1) % self.freq_steps == 0)
        hit |= bool(self.freq_epochs and step + 1 == self.steps_per_epoch
                    and (epoch + 1) % self.freq_epochs == 0)
        hit |= bool(self.freq_secs and now - self._last >= self.freq_secs)
        if hit:
            self._last = now
        return hit


class Evaluator(_Timer):
    def __init__(self, config: EvaluatorConfig | EvaluationConfig,
                 ft_spec: FinetuneSpec) -> None:
        super().__init__(config, ft_spec)

    def evaluate(self, evaluate_fn: Callable[[], Any], epoch: int, step: int,
                 global_step: int) -> None:
        if self.due(epoch, step, global_step):
            evaluate_fn()


class Saver(_Timer):
    """Saves the actor's weights as an HF folder `epoch<e>_step<s>_global<g>` under
    `get_save_checkpoint_root(config.saver)` (ours: `checkpoint.save_dir`, default
    `<run dir>/checkpoints`). For exact resume use our recipes' `checkpoint.recover=auto`."""

    def __init__(self, config: SaverConfig | CheckpointConfig, ft_spec: FinetuneSpec,
                 for_recover: bool = False, run_root: str = "runs") -> None:
        super().__init__(config, ft_spec)
        self.root = Path(self.get_save_checkpoint_root(config) if isinstance(config, SaverConfig)
                         else config.save_dir or Path(run_root) / "checkpoints")

    @staticmethod
    def get_save_checkpoint_root(config: SaverConfig) -> str:
        """`<fileroot>/<experiment_name>/<trial_name>/checkpoints`: in the run's folder (AReaL-
        lite's is `<fileroot>/checkpoints/<user>/<experiment_name>/<trial_name>`)."""
        return str(Path(config.fileroot or "runs") / config.experiment_name / config.trial_name
                   / "checkpoints")

    def save(self, engine: FSDPEngine, epoch: int, step: int, global_step: int) -> None:
        if self.due(epoch, step, global_step):
            path = self.root / f"epoch{epoch}_step{step}_global{global_step}"
            engine.save(SaveLoadMeta(path=str(path.resolve())))


class WeightUpdateMeta(_WeightUpdateMeta):
    """Ours, and AReaL-lite's `from_disk(config.saver)`: the weights go to
    `<Saver.get_save_checkpoint_root(saver)>/weight_update`, overwritten at each update."""

    @classmethod
    def from_disk(cls, path: str | SaverConfig, version: int = 0) -> _WeightUpdateMeta:
        if isinstance(path, SaverConfig):
            path = str(Path(Saver.get_save_checkpoint_root(path)).resolve() / "weight_update")
        return super().from_disk(path, version)


class StatsLogger:
    """Commits a step's stats (plus the stats tracker's) to metrics.jsonl / tensorboard on
    rank 0; `info` logs a line (AReaL-lite scripts call it on the same name)."""

    def __init__(self, config: StatsLoggerConfig | LoggingConfig, ft_spec: FinetuneSpec) -> None:
        config = _as_logging(config)
        self._metrics = (MetricsLogger(config) if not dist.is_initialized()
                         or dist.get_rank() == 0 else None)

    @staticmethod
    def get_log_path(config: StatsLoggerConfig | LoggingConfig) -> str:
        """The run's folder: `<log_dir>/<experiment_name>/<trial_name>` (AReaL-lite's
        `fileroot` is our `log_dir`)."""
        return str(run_dir(_as_logging(config)))

    def info(self, message: str, *args: Any) -> None:
        logger.info(message, *args)

    def commit(self, epoch: int, step: int, global_step: int,
               stats: dict[str, float] | list[dict[str, float]]) -> None:
        merged: dict[str, float] = {}
        for part in stats if isinstance(stats, list) else [stats]:
            merged.update(part)
        merged.update(stats_tracker.export())
        if self._metrics is not None:
            self._metrics.log(global_step + 1, {k: v for k, v in merged.items()
                                                if isinstance(v, (int, float))})

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()


def _as_logging(config: StatsLoggerConfig | LoggingConfig) -> LoggingConfig:
    if isinstance(config, LoggingConfig):
        return config
    mode = config.wandb.get("mode", "disabled")
    wandb = WandbConfig(enabled=mode != "disabled",
                        mode="online" if mode == "online" else "offline")
    return LoggingConfig(experiment_name=config.experiment_name or "default",
                         trial_name=config.trial_name or "trial0",
                         log_dir=config.fileroot or "runs", wandb=wandb)


class seeding:  # noqa: N801 - AReaL-lite's module name
    @staticmethod
    def set_random_seed(seed: int, key: str = "") -> None:
        """Seed Python, NumPy and torch from (seed, key): each rank its own stream."""
        derived = derive_seed(seed, key) % (2**32)
        random.seed(derived)
        np.random.seed(derived)
        torch.manual_seed(derived)


def log_gpu_stats(head: str) -> None:
    if torch.cuda.is_available():
        logger.debug("%s: %.2f GiB allocated", head, torch.cuda.memory_allocated() / 2**30)
