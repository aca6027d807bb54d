"""AReaL-lite's training-script helpers on ours: the PPO actor as an engine, the stats
logger, the saver and the evaluator timers, seeding."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.api import FinetuneSpec, SaveLoadMeta
from areal_like.api.algorithm_config import AlgorithmConfig
from areal_like.api.config import (
    CheckpointConfig,
    EvaluationConfig,
    LoggingConfig,
    TrainEngineConfig,
)
from areal_like.api.seeding import derive_seed
from areal_like.arealite.engines import FSDPEngine
from areal_like.utils import stats_tracker
from areal_like.utils.metrics_logger import MetricsLogger, run_dir

logger = logging.getLogger("areal_like")


class FSDPPPOActor(FSDPEngine):
    """AReaL-lite's PPO actor: our FSDP engine with a `PPOActor` (our settings live in the
    `algorithm` section; AReaL-lite keeps them in `actor`)."""

    def __init__(self, config: TrainEngineConfig,
                 algorithm: Optional[AlgorithmConfig] = None) -> None:
        super().__init__(config)
        self.actor = PPOActor(self, algorithm if algorithm is not None else AlgorithmConfig())

    def compute_logp(self, batch: TensorDict) -> torch.Tensor:
        return self.actor.compute_logp(batch)

    def compute_advantages(self, batch: TensorDict) -> TensorDict:
        """In place, as in AReaL-lite: `batch` gains `advantages` (and is next-token aligned)."""
        batch.update(self.actor.compute_advantages(batch))
        return batch

    def ppo_update(self, batch: TensorDict) -> list[dict[str, float]]:
        return [self.actor.update(batch)]


class _Timer:
    """Every `freq_steps` global steps (AReaL-lite also has epochs and seconds; ours: steps)."""

    def __init__(self, freq_steps: int) -> None:
        self.freq_steps = freq_steps

    def due(self, global_step: int) -> bool:
        return self.freq_steps > 0 and (global_step + 1) % self.freq_steps == 0


class Evaluator(_Timer):
    def __init__(self, config: EvaluationConfig, ft_spec: FinetuneSpec) -> None:
        super().__init__(config.freq_steps)

    def evaluate(self, evaluate_fn: Callable[[], Any], epoch: int, step: int,
                 global_step: int) -> None:
        if self.due(global_step):
            evaluate_fn()


class Saver(_Timer):
    """Saves the actor's weights as an HF folder under `checkpoint.save_dir` (default:
    `<run dir>/checkpoints`) every `checkpoint.freq_steps` steps. For exact resume use our
    recipes' `checkpoint.recover=auto`."""

    def __init__(self, config: CheckpointConfig, ft_spec: FinetuneSpec,
                 for_recover: bool = False, run_root: str = "runs") -> None:
        super().__init__(config.freq_steps)
        self.root = Path(config.save_dir or Path(run_root) / "checkpoints")

    def save(self, engine: FSDPEngine, epoch: int, step: int, global_step: int) -> None:
        if self.due(global_step):
            path = self.root / f"epoch{epoch}_step{step}_global{global_step}"
            engine.save(SaveLoadMeta(path=str(path.resolve())))


class StatsLogger:
    """Commits a step's stats (plus the stats tracker's) to metrics.jsonl / tensorboard on
    rank 0; `info` logs a line (AReaL-lite scripts call it on the same name)."""

    def __init__(self, config: LoggingConfig, ft_spec: FinetuneSpec) -> None:
        self._metrics = (MetricsLogger(config) if not dist.is_initialized()
                         or dist.get_rank() == 0 else None)

    @staticmethod
    def get_log_path(config: LoggingConfig) -> str:
        return str(run_dir(config))

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
