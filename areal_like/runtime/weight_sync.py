"""Moving the trainer's weights to the inference fleet after an update."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

from areal_like.api import FleetClient, TrainEngine, WeightUpdateMeta
from areal_like.runtime.main_rank import run_on_main
from areal_like.runtime.weight_broadcast import WeightBroadcaster
from engines.fleet.updater import FleetUpdater

# what loads weights on the fleet: trainer rank 0's updater (it drives the servers itself),
# or any fleet client (in one process: tests, scripts)
WeightLoader = Union[FleetUpdater, FleetClient]


def push_weights(engine: TrainEngine, fleet: Optional[WeightLoader], version: int,
                 root: Path, keep: int = 2, collective_timeout_s: float = 600.0,
                 broadcaster: Optional[WeightBroadcaster] = None,
                 in_memory: bool = False) -> dict[str, float]:
    """Send `engine`'s weights to every server as version `version`: over the process group
    of `broadcaster` when one is given (the distributed transport, see
    `areal_like.runtime.weight_broadcast`), else through a folder under `root`. A LoRA
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
            raise TypeError(f"the distributed transport needs trainer rank 0's FleetUpdater, "
                            f"got {type(fleet).__name__}")
        return broadcaster.push(engine, fleet, version)
    # absolute: servers started elsewhere resolve relative paths against their own cwd
    meta = WeightUpdateMeta.from_disk(str(root.resolve() / f"v{version}"), version)
    start = time.perf_counter()
    with _held_ahead(fleet, meta):
        engine.update_weights(meta)
    exported = time.perf_counter()

    def load_on_fleet() -> None:
        if fleet is None:
            return
        fleet.update_weights(meta)  # pause (retract) -> load -> version label -> continue
        for old in sorted(root.glob("v*")):
            if old.name[1:].isdigit() and int(old.name[1:]) <= version - keep:
                shutil.rmtree(old, ignore_errors=True)

    run_on_main(load_on_fleet, f"loading weights version {version} on the fleet",
                collective_timeout_s)
    engine.set_version(version)
    return {"weight_sync/export_s": exported - start,
            "weight_sync/load_s": time.perf_counter() - exported, **_timings_of(fleet)}


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
