"""Moving the trainer's weights to the inference fleet after an update."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

from areal_like.api import FleetClient, TrainEngine, WeightUpdateMeta
from areal_like.runtime.main_rank import run_on_main
from areal_like.runtime.weight_broadcast import WeightBroadcaster
from areal_like.runtime.weight_delta import WeightDeltaPusher
from engines.fleet.updater import FleetUpdater

# what loads weights on the fleet: trainer rank 0's updater (it drives the servers itself),
# or any fleet client (in one process: tests, scripts)
WeightLoader = Union[FleetUpdater, FleetClient]
# a transport whose every rank takes part in an update: distributed, delta
WeightPusher = Union[WeightBroadcaster, WeightDeltaPusher]


def push_weights(engine: TrainEngine, fleet: Optional[WeightLoader], version: int,
                 root: Path, keep: int = 2, collective_timeout_s: float = 600.0,
                 broadcaster: Optional[WeightPusher] = None,
                 in_memory: bool = False) -> dict[str, float]:
    """Send `engine`'s weights to every server as version `version`: by `broadcaster` when
    one is given (the distributed transport, `areal_like.runtime.weight_broadcast`, or the
    delta transport, `areal_like.runtime.weight_delta`), else through a folder under `root`. A LoRA
    engine sends its adapter only: a PEFT folder under `root`, or with `in_memory` (the
    distributed transport) the adapter's tensors in the load request itself.

    Every trainer rank calls this; only rank 0 passes `fleet`. Rollouts keep running while
    the trainer writes the folder; the fleet is then paused (in-flight requests retracted,
    not lost), loads the folder labelled `version`, and continues — so tokens generated
    across the switch report both versions. Old folders beyond the last `keep` are removed.
    The other ranks wait for the fleet with heartbeats (`run_on_main`), so a slow load does
    not outlast their `collective_timeout_s`, and a failed one fails every rank alike.
    """
    if engine.lora_enabled and in_memory:
        return _push_adapter(engine, fleet, version, collective_timeout_s)
    if broadcaster is not None:
        if fleet is not None and not isinstance(fleet, FleetUpdater):
            raise TypeError(f"the {type(broadcaster).__name__} transport needs trainer rank "
                            f"0's FleetUpdater, got {type(fleet).__name__}")
        return broadcaster.push(engine, fleet, version)
    meta, start, exported = _export_folder(engine, fleet, version, root)

    def load_on_fleet() -> None:
        if fleet is None:
            return
        fleet.update_weights(meta)  # pause (retract) -> load -> version label -> continue
        _remove_old_folders(root, version, keep)

    run_on_main(load_on_fleet, f"loading weights version {version} on the fleet",
                collective_timeout_s)
    engine.set_version(version)
    return {"weight_sync/export_s": exported - start,
            "weight_sync/load_s": time.perf_counter() - exported, **_timings_of(fleet)}


def _export_folder(engine: TrainEngine, fleet: Optional[WeightLoader], version: int,
                   root: Path) -> tuple[WeightUpdateMeta, float, float]:
    """Write `version` as an HF folder under `root` (rank 0's updater asks for the fleet's
    hold meanwhile); returns its meta and when the export began and ended."""
    # absolute: servers started elsewhere resolve relative paths against their own cwd
    meta = WeightUpdateMeta.from_disk(str(root.resolve() / f"v{version}"), version)
    start = time.perf_counter()
    with _held_ahead(fleet, meta):
        engine.update_weights(meta)
    return meta, start, time.perf_counter()


def _remove_old_folders(root: Path, version: int, keep: int) -> None:
    for old in sorted(root.glob("v*")):
        if old.name[1:].isdigit() and int(old.name[1:]) <= version - keep:
            shutil.rmtree(old, ignore_errors=True)


class FleetLoadBesideTraining:
    """A folder's load on the fleet while the trainer goes on (`rollout.weights.overlap_load`).

    The trainer exports version k and takes the fleet's hold (so the rollout controller
    knows of version k before the trainer asks it for a batch: it then drops what is more
    than η versions older than k, as if the fleet held k already); the servers' pause, load
    and continue run in rank 0's updater thread while the trainer trains step k. `wait()`
    (every rank; the others wait for rank 0 with heartbeats) ends it: before the next
    export, an evaluation of the new version, a checkpoint, and the end of the run. A failed
    load fails that `wait()` on every rank, as it fails `push_weights`."""

    def __init__(self, collective_timeout_s: float) -> None:
        self.collective_timeout_s = collective_timeout_s
        self._version: Optional[int] = None
        self._future: Optional[concurrent.futures.Future[None]] = None
        self._fleet: Optional[FleetUpdater] = None
        self._root, self._keep = Path("."), 2  # where the folders are, how many stay

    @property
    def pending(self) -> bool:
        return self._version is not None

    def start(self, engine: TrainEngine, fleet: Optional[FleetUpdater], version: int,
              root: Path, keep: int = 2) -> dict[str, float]:
        """Export `version` (every rank) and start its load (rank 0); returns the export's
        time. The previous load must have been waited for."""
        if self.pending:
            raise RuntimeError(f"weights version {self._version} is still loading: wait() "
                               f"before starting version {version}")
        meta, start, exported = _export_folder(engine, fleet, version, root)

        def begin() -> None:
            if fleet is not None:
                self._future = fleet.start_update(meta)

        run_on_main(begin, f"holding the fleet for weights version {version}",
                    self.collective_timeout_s)
        self._version, self._fleet = version, fleet
        self._root, self._keep = root, keep
        engine.set_version(version)
        return {"weight_sync/export_s": exported - start,
                "weight_sync/hold_wait_s": time.perf_counter() - exported}

    def wait(self) -> dict[str, float]:
        """End the load under way (if any): how long the trainer waited for it, and where
        the load spent its time (beside training)."""
        if self._version is None:
            return {}
        version, self._version = self._version, None
        future, self._future = self._future, None
        fleet = self._fleet
        waited = time.perf_counter()

        def finish() -> None:
            if future is not None:
                assert fleet is not None
                future.result(timeout=fleet.update_bound_s)
                _remove_old_folders(self._root, version, self._keep)

        run_on_main(finish, f"loading weights version {version} on the fleet",
                    self.collective_timeout_s)
        return {"weight_sync/load_wait_s": time.perf_counter() - waited, **_timings_of(fleet)}


def _push_adapter(engine: TrainEngine, fleet: Optional[WeightLoader], version: int,
                  collective_timeout_s: float) -> dict[str, float]:
    """The LoRA adapter, gathered to rank 0 and sent to every server in memory."""
    start = time.perf_counter()
    adapter = engine.adapter_weights()  # collective
    gathered = time.perf_counter()

    def load_on_fleet() -> None:
        if fleet is not None and adapter is not None:
            fleet.update_weights(WeightUpdateMeta.from_adapter(adapter, version))

    run_on_main(load_on_fleet, f"loading adapter version {version} on the fleet",
                collective_timeout_s)
    engine.set_version(version)
    return {"weight_sync/export_s": gathered - start,
            "weight_sync/load_s": time.perf_counter() - gathered, **_timings_of(fleet)}


@contextlib.contextmanager
def _held_ahead(fleet: Optional[WeightLoader], meta: WeightUpdateMeta) -> Iterator[None]:
    """Rank 0's updater asks for the fleet's hold while the weights are exported; a failed
    export gives it back."""
    if not isinstance(fleet, FleetUpdater):
        yield
        return
    fleet.hold_ahead(meta)
    try:
        yield
    except BaseException:
        fleet.release_ahead()
        raise


def _timings_of(fleet: Optional[WeightLoader]) -> dict[str, float]:
    """Rank 0's split of `load_s`: holding the fleet, then the servers' own work."""
    return dict(fleet.last_timings) if isinstance(fleet, FleetUpdater) else {}
