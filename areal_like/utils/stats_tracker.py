"""Scoped statistics: masked means, scalars and timings, reduced across distributed ranks.

    from areal_like.utils import stats_tracker
    with stats_tracker.scope("actor"):
        stats_tracker.denominator(n_tokens=loss_mask)
        stats_tracker.stat(entropy=entropy, denominator="n_tokens")   # actor/entropy/{avg,min,max}
        stats_tracker.scalar(lr=1e-5)                                  # actor/lr
        with stats_tracker.record_timing("update"):                    # timeperf/actor/update
            ...
    metrics = stats_tracker.export()                                   # reduces and resets

Every later component reports through a tracker; sinks (console, JSONL, tensorboard, wandb)
live in `areal_like.utils.metrics_logger` and consume what `export` returns.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

# Set by the train engine on every rank of a sequence-parallel group but its first: those
# ranks compute what the first records already (the same rows), and their records would count
# every token again when `export` reduces over the ranks.
_records_duplicated = False


def set_records_duplicated(duplicated: bool) -> None:
    """On (True) this process records nothing: `denominator`, `stat`, `scalar` and `add`
    become no-ops (timings still count); `export` still takes part in the reduction."""
    global _records_duplicated
    _records_duplicated = duplicated


def _recording() -> bool:
    return not _records_duplicated


class StatsTracker:
    """Accumulates statistics between two `export` calls. Thread-safe."""

    def __init__(self, name: str = "") -> None:
        self._lock = threading.RLock()
        self._scopes = threading.local()
        self._root = name
        self._denominators: dict[str, torch.Tensor] = {}
        # key -> list of (values, mask) pairs, both 1-D after flattening
        self._masked: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._scalars: dict[str, list[float]] = defaultdict(list)
        self._sums: dict[str, float] = defaultdict(float)

    # ---- naming -------------------------------------------------------------------------
    def _stack(self) -> list[str]:
        if not hasattr(self._scopes, "stack"):
            self._scopes.stack = [self._root] if self._root else []
        return self._scopes.stack

    def _key(self, name: str) -> str:
        return "/".join([*self._stack(), name])

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix every name recorded inside the block with `name/`."""
        stack = self._stack()
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def outside(self, name: str) -> Iterator[None]:
        """Inside the block, names are recorded as if the innermost open scope were closed,
        when it is `name` (a statistic of the whole batch recorded from inside one step's
        `name` scope keeps the batch's name); otherwise nothing changes."""
        stack = self._stack()
        if not stack or stack[-1] != name:
            yield
            return
        stack.pop()
        try:
            yield
        finally:
            stack.append(name)

    # ---- recording ----------------------------------------------------------------------
    def denominator(self, **masks: torch.Tensor) -> None:
        """Register boolean masks that later `stat` calls average over (by name)."""
        if not _recording():
            return
        with self._lock:
            for name, mask in masks.items():
                if mask.dtype != torch.bool:
                    raise TypeError(f"denominator {name!r} must be a bool tensor, got {mask.dtype}")
                self._denominators[self._key(name)] = mask.detach().reshape(-1).cpu()
                self._masked[self._key(name)].append(
                    (mask.detach().reshape(-1).float().cpu(), torch.ones(mask.numel()))
                )

    def stat(self, denominator: str, **values: torch.Tensor) -> None:
        """Record masked statistics (avg/min/max over the denominator's True entries)."""
        if not _recording():
            return
        with self._lock:
            key = self._key(denominator)
            if key not in self._denominators:
                raise KeyError(
                    f"stat(): denominator {denominator!r} (as {key!r}) was not registered; "
                    f"call stats_tracker.denominator({denominator}=mask) first"
                )
            mask = self._denominators[key]
            for name, value in values.items():
                flat = value.detach().reshape(-1).float().cpu()
                if flat.shape != mask.shape:
                    raise ValueError(
                        f"stat {name!r} has {flat.numel()} elements but denominator "
                        f"{denominator!r} has {mask.numel()}"
                    )
                self._masked[self._key(name)].append((flat, mask.float()))

    def scalar(self, **values: float) -> None:
        """Record plain numbers; each key exports the mean of its recorded values."""
        if not _recording():
            return
        with self._lock:
            for name, value in values.items():
                self._scalars[self._key(name)].append(float(value))

    def add(self, **values: float) -> None:
        """Record counters; each key exports the sum of what was added."""
        if not _recording():
            return
        with self._lock:
            for name, value in values.items():
                self._sums[self._key(name)] += float(value)

    @contextlib.contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        """Time the block; exported as `timeperf/<scope>/<name>` in seconds (summed)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = "/".join(["timeperf", *self._stack(), name])
            with self._lock:
                self._sums[key] += time.perf_counter() - start

    # ---- export -------------------------------------------------------------------------
    def export(
        self, reduce_group: Optional[Any] = None, reset: bool = True
    ) -> dict[str, float]:
        """Reduce everything recorded (across `reduce_group` when distributed) to floats.

        Masked stats give `<key>/avg`, `/min`, `/max`; a denominator gives its count of True
        entries; scalars give their mean; `add` counters and timings give their sum. Ranks
        may record different keys: the union is reduced.
        """
        with self._lock:
            masked = {k: list(v) for k, v in self._masked.items()}
            scalars_rec = {k: list(v) for k, v in self._scalars.items()}
            sums_rec = dict(self._sums)
            denominators = set(self._denominators)
            if reset:
                self._denominators.clear()
                self._masked.clear()
                self._scalars.clear()
                self._sums.clear()

        distributed = dist.is_available() and dist.is_initialized()
        masked_keys, scalar_keys, sum_keys = sorted(masked), sorted(scalars_rec), sorted(sums_rec)
        if distributed:
            # Ranks may record different keys (e.g. only rank 0 runs rollout): reduce over the
            # union, a missing key contributing nothing.
            world = dist.get_world_size(reduce_group)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (masked_keys, scalar_keys, sum_keys,
                                              sorted(denominators)), group=reduce_group)
            masked_keys = sorted({k for g in gathered for k in g[0]})
            scalar_keys = sorted({k for g in gathered for k in g[1]})
            sum_keys = sorted({k for g in gathered for k in g[2]})
            denominators = {k for g in gathered for k in g[3]}

        sums = torch.zeros(len(masked_keys), 2, dtype=torch.float64)  # weighted sum, count
        mins = torch.full((len(masked_keys),), float("inf"), dtype=torch.float64)
        maxs = torch.full((len(masked_keys),), float("-inf"), dtype=torch.float64)
        for i, key in enumerate(masked_keys):
            for values, mask in masked.get(key, []):
                sel = values[mask.bool()].double()
                sums[i, 0] += sel.sum()
                sums[i, 1] += sel.numel()
                if sel.numel():
                    mins[i] = min(mins[i], sel.min())
                    maxs[i] = max(maxs[i], sel.max())
        scalars = torch.tensor(
            [[sum(scalars_rec.get(k, [])), len(scalars_rec.get(k, []))] for k in scalar_keys],
            dtype=torch.float64,
        ).reshape(-1, 2)
        counters = torch.tensor([sums_rec.get(k, 0.0) for k in sum_keys], dtype=torch.float64)

        if distributed:
            for tensor, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN),
                               (maxs, dist.ReduceOp.MAX), (scalars, dist.ReduceOp.SUM),
                               (counters, dist.ReduceOp.SUM)):
                dist.all_reduce(tensor, op=op, group=reduce_group)

        out: dict[str, float] = {}
        for i, key in enumerate(masked_keys):
            if key in denominators:
                out[key] = float(sums[i, 0])  # number of True entries
                continue
            count = float(sums[i, 1])
            if count > 0:
                out[f"{key}/avg"] = float(sums[i, 0]) / count
                out[f"{key}/min"] = float(mins[i])
                out[f"{key}/max"] = float(maxs[i])
        for i, key in enumerate(scalar_keys):
            out[key] = float(scalars[i, 0] / scalars[i, 1])
        for i, key in enumerate(sum_keys):
            out[key] = float(counters[i])
        return out


DEFAULT_TRACKER = StatsTracker()
scope = DEFAULT_TRACKER.scope
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
scalar = DEFAULT_TRACKER.scalar
add = DEFAULT_TRACKER.add
record_timing = DEFAULT_TRACKER.record_timing
export = DEFAULT_TRACKER.export
