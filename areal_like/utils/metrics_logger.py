"""Sinks for exported statistics: console, JSONL, tensorboard, and the experiment trackers
(W&B, MLflow, Trackio: areal_like/utils/trackers/) a run enables."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from areal_like.api.config import LoggingConfig
from areal_like.utils.atomic_file import write_atomic
from areal_like.utils.trackers import Trackers


def run_dir(config: LoggingConfig) -> Path:
    """`<log_dir>/<experiment_name>/<trial_name>`: where a run writes logs and checkpoints."""
    return Path(config.log_dir) / config.experiment_name / config.trial_name


def _format_value(value: float) -> str:
    if value == 0 or (1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    return f"{value:.3e}"


def console_interval(every: int, total_steps: Optional[int]) -> int:
    """Steps between console metric lines: `every`, or for 0 about 50 lines over the run
    (every step when the run's length is unknown)."""
    if every > 0:
        return every
    return max(1, (total_steps or 0) // 50)


class MetricsLogger:
    """Writes one record per step to every enabled sink. Only rank 0 should create one.

    `console_keys` picks what the one-line console summary shows (all keys go to the files),
    at the interval `console_interval` gives (`LoggingConfig.console_every`, `total_steps`).
    `fresh=True` starts new files (a new run); `fresh=False` appends (a recovered run), first
    dropping the records after step `keep_through` (those of the killed run's steps past its
    checkpoint, which the recovered run logs again), so no step appears twice.
    `run_config` (the run's whole config) goes to the trackers as their run's config.
    """

    def __init__(
        self,
        config: LoggingConfig,
        console_keys: Optional[list[str]] = None,
        out_dir: Optional[Path] = None,
        fresh: bool = True,
        keep_through: Optional[int] = None,
        total_steps: Optional[int] = None,
        run_config: Optional[dict[str, Any]] = None,
    ) -> None:
        self.config = config
        self.console_every = console_interval(config.console_every, total_steps)
        self.total_steps = total_steps
        self._printed_any = False
        self.dir = Path(out_dir) if out_dir is not None else run_dir(config)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console_keys = console_keys
        self.jsonl_path = self.dir / "metrics.jsonl"
        if fresh:
            self.jsonl_path.unlink(missing_ok=True)
            shutil.rmtree(self.dir / "tensorboard", ignore_errors=True)
        elif keep_through is not None:
            truncate_jsonl(self.jsonl_path, keep_through)
        self._jsonl = open(self.jsonl_path, "a") if config.jsonl else None  # noqa: SIM115
        self._tb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if fresh or keep_through is None else keep_through + 1
            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=purge)
        # last: a tracker that cannot start fails the run here, with the reason
        self.trackers = Trackers(config, self.dir, run_config or {}, fresh=fresh)
        if not fresh and self.trackers.enabled and self.jsonl_path.exists():
            # what a tracker lacks of the records kept (a kill took what it had queued, or it
            # was enabled only now) goes to it first; what it holds is skipped
            for kept in read_jsonl(self.jsonl_path):
                self.trackers.log(kept["step"], {k: v for k, v in kept.items()
                                                 if k not in ("step", "time")})
        self._start = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        record = {"step": step, "time": round(time.time() - self._start, 3), **values}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if math.isfinite(float(value)):
                    self._tb.add_scalar(key, float(value), global_step=step)
            self._tb.flush()
        self.trackers.log(step, values)
        if self.config.console and self._shows(step, metrics):
            keys = self.console_keys if self.console_keys is not None else sorted(metrics)
            shown = " ".join(
                f"{k}={_format_value(float(metrics[k]))}" for k in keys if k in metrics
            )
            # around the progress bar, not through it
            tqdm.write(f"[step {step}] {shown}", file=sys.stdout)
            sys.stdout.flush()

    def _shows(self, step: int, metrics: dict[str, Any]) -> bool:
        """A console line for the first record, every `console_every`-th step, the last
        step, and every record with held-out results."""
        first, self._printed_any = not self._printed_any, True
        return (first or step % self.console_every == 0 or step == self.total_steps
                or any(k.startswith("eval/") for k in metrics))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.trackers.close()


def truncate_jsonl(path: Path, keep_through: int) -> None:
    """Drop the records of `path` whose step is after `keep_through` (atomically)."""
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r["step"] <= keep_through]
    write_atomic(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics file written by `MetricsLogger`, naming the file and line on a bad record.
    A last line without its newline is a record still being written (or cut by a kill): it
    is not a record yet, and is left out."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or not line.endswith("\n"):
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({e})") from e
    return records


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """One record per step, in step order: the records a step got later (an evaluation of that
    step's weights, finished while training went on) are merged into it; a later value wins
    and `time` is the step's first."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_jsonl(path):
        merged = by_step.setdefault(record["step"], {})
        merged.update({k: v for k, v in record.items() if k != "time" or "time" not in merged})
    return [by_step[step] for step in sorted(by_step)]
