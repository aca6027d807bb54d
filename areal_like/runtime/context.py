"""What a recipe process needs around its loop: distributed set-up, seeding, run folder,
metrics sinks, timing, and moving a rollout batch from rank 0 to every trainer rank."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api.config import BaseExperimentConfig
from areal_like.api.config_loader import to_yaml
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.main_rank import run_on_main
from areal_like.runtime.preflight_models import read_model_config
from areal_like.utils import stats_tracker
from areal_like.utils.distributed import ensure_process_group, resolve_device_and_backend
from areal_like.utils.launch_clock import process_started_at
from areal_like.utils.launcher_state import launcher_metrics
from areal_like.utils.metrics_logger import MetricsLogger, read_metrics, run_dir, truncate_jsonl
from areal_like.utils.quiet import silence_library_progress_bars
from areal_like.utils.start_costs import record_start
from engines.fsdp.packing import attention_width, shard_rows

logger = logging.getLogger("areal_like")
T = TypeVar("T")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RunContext:
    """Per-process run state. Rank 0 owns the metric sinks and the rollout engine."""

    def __init__(self, config: BaseExperimentConfig, console_keys: Optional[list[str]] = None):
        self.config = config
        silence_library_progress_bars()  # the run's own bar and metric lines only
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # the actor engine's backend: the engine then joins this group instead of making one
        device, backend = resolve_device_and_backend(config.actor.backend)
        ensure_process_group(backend, device, config.actor.collective_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # which rows of a batch this rank trains (a sequence-parallel group shares its rows)
        parallel = config.actor.parallel
        self.data_parallel_size = parallel.data_parallel_size(self.world_size)
        self.data_parallel_rank = parallel.data_parallel_rank(self.rank)
        # rows go to data-parallel ranks by compute (attention included) or by tokens
        model = read_model_config(config.actor.model.path or config.model.path)
        self.balance_width = (attention_width(model) if model is not None
                              and config.actor.mb_spec.balance == "compute" else 0.0)
        seed_everything(config.seed + self.rank)
        self.dir = run_dir(config.logging)
        self.is_main = self.rank == 0
        self.metrics: Optional[MetricsLogger] = None
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(to_yaml(config))
            latest = (Checkpointer(config.checkpoint, self.dir).latest()
                      if config.checkpoint.recover == "auto" else None)
            # checkpoint `stepN` was saved after the metrics of step N + 1 were logged
            keep = int(latest.name.removeprefix("step")) + 1 if latest else None
            self.metrics = MetricsLogger(config.logging, console_keys=console_keys,
                                         fresh=latest is None, keep_through=keep,
                                         total_steps=config.total_train_steps,
                                         run_config=dataclasses.asdict(config))
            # which episodes each step trained on (ids), continued like the metrics
            self.episodes_log = self.dir / "episodes.jsonl"
            if latest is None:
                self.episodes_log.unlink(missing_ok=True)
            else:
                assert keep is not None
                truncate_jsonl(self.episodes_log, keep)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        self._step_start = time.perf_counter()

    @property
    def weights_dir(self) -> Path:
        return self.dir / "weights"

    @contextlib.contextmanager
    def timing(self, name: str) -> Iterator[None]:
        with stats_tracker.record_timing(name):
            yield

    def on_main(self, fn: Callable[[], T], what: str) -> Optional[T]:
        """Run `fn` on rank 0 while the other ranks wait without hitting the collective
        timeout; a failure there raises the same `MainRankError` on every rank."""
        return run_on_main(fn, what, self.config.actor.collective_timeout)

    def scatter_batch(self, batch: Optional[TensorDict], group_size: int) -> TensorDict:
        """Rank 0's batch, split so each data-parallel rank gets its own rows (groups kept
        whole): rank 0 sends each rank only its shard (the ranks of a sequence-parallel group
        the same one)."""
        if self.world_size == 1:
            assert batch is not None
            return batch
        shards: Optional[list[TensorDict]] = None
        if self.rank == 0:
            assert batch is not None
            per_dp_rank = [batch[torch.as_tensor(rows, dtype=torch.long)]
                           for rows in shard_rows(batch, self.data_parallel_size, group_size,
                                                  self.balance_width)]
            parallel = self.config.actor.parallel
            shards = [per_dp_rank[parallel.data_parallel_rank(r)] for r in range(self.world_size)]
        received: list[Optional[TensorDict]] = [None]
        dist.scatter_object_list(received, shards, src=0)
        assert received[0] is not None, "rank 0 sent no batch"
        return received[0]

    def global_mean(self, values: torch.Tensor) -> float:
        """Mean of `values` over every rank's entries."""
        total = torch.tensor([values.sum().item(), values.numel()], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def log_step(self, step: int, stats: dict[str, float]) -> dict[str, float]:
        """Export every tracker's statistics (reduced over ranks) and write them (rank 0)."""
        metrics = {**stats, **stats_tracker.export()}
        if metrics.get("timeperf/train") and "n_tokens" in metrics:
            metrics["perf/train_tokens_per_s"] = metrics["n_tokens"] / metrics["timeperf/train"]
        now = time.perf_counter()
        # step 0 is logged before training: its time is the start-up's
        metrics["timeperf/startup" if step == 0 else "timeperf/step"] = now - self._step_start
        self._step_start = now
        if step == 0 and self.is_main:  # from this rank's start (the test command's table)
            record_start("trainer (torchrun rank)", time.time() - process_started_at(),
                         type(self.config).__name__)
        if self.metrics is not None:
            metrics.update(launcher_metrics())  # restart counts, under the Ray launcher
            self.metrics.log(step, metrics)
        return metrics

    def log_late(self, step: int, metrics: dict[str, float]) -> None:
        """Write `metrics` that belong to an earlier `step` (an evaluation of the weights of
        that step, finished later), as a record of their own (rank 0)."""
        if self.metrics is not None:
            self.metrics.log(step, metrics)

    def log_episodes(self, step: int, **ids: list[str]) -> None:
        """Append `{"step": step, <kind>: [episode ids]}` to `episodes.jsonl` (rank 0)."""
        if self.metrics is None:
            return
        with open(self.episodes_log, "a") as f:
            f.write(json.dumps({"step": step, **ids}) + "\n")

    def summarize(self, key: str) -> None:
        """Print the first and last logged value of `key` (rank 0), e.g. before/after RL."""
        if self.metrics is None:
            return
        values = [r[key] for r in read_metrics(self.metrics.jsonl_path) if key in r]
        if values:
            print(f"{key}: {values[0]:.3f} before -> {values[-1]:.3f} after "
                  f"({len(values)} evaluations; metrics in {self.metrics.jsonl_path})", flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
