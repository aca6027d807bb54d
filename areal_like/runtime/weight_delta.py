"""The trainer's side of the delta transport (`rollout.weights.transport=delta`): only the
bytes that changed since the fleet's version travel, as a weight file in a shared directory.

Every trainer rank runs `WeightDeltaPusher.push`: the FSDP shards are gathered bucket by
bucket (a collective, as for a broadcast) and rank 0 compares each tensor with the copy it
last sent (`engines.weight_transport.delta_trainer.DeltaSender`), writing what changed;
meanwhile its `FleetUpdater` asks for the fleet's hold. Then each server applies the file
(`engines.weight_transport.delta_fleet`): the delta where it holds the base, else the full
version (written once, when first needed). The other ranks wait with heartbeats.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from areal_like.api import TrainEngine, WeightUpdateMeta
from areal_like.api.config import RolloutConfig
from areal_like.runtime.main_rank import run_on_main
from engines.fleet.updater import FleetUpdater
from engines.weight_transport.delta_trainer import DeltaSender
from engines.weight_transport.process_group_trainer import plan_buckets


class WeightDeltaPusher:
    def __init__(self, config: RolloutConfig, directory: Path,
                 collective_timeout_s: float = 600.0) -> None:
        self.config = config
        self.collective_timeout_s = collective_timeout_s
        weights = config.weights
        self.sender = DeltaSender(directory, weights.delta_codec, weights.delta_zstd_level)

    def push(self, engine: TrainEngine, fleet: Optional[FleetUpdater],
             version: int) -> dict[str, float]:
        """Send `engine`'s weights to the fleet as `version` (every rank calls this; rank 0
        passes its `fleet` updater). Returns timings and what the file held."""
        if engine.lora_enabled:
            raise ValueError("rollout.weights.transport=delta sends whole weights; a LoRA run "
                             "sends its adapter (transport=disk or distributed)")
        start = time.perf_counter()
        specs = engine.weight_specs()
        buckets = plan_buckets(specs, int(self.config.weights.bucket_mb * 2**20))
        meta: Optional[WeightUpdateMeta] = None
        if fleet is not None:
            path, base_version, base_digest = self.sender.begin(version)
            meta = WeightUpdateMeta.from_delta(str(path.resolve()), version, base_version,
                                               base_digest)
            fleet.hold_ahead(meta)  # the rollout process's turn while the file is written
        failed: Optional[BaseException] = None
        for bucket, tensors in zip(buckets, engine.iter_weight_buckets(buckets), strict=True):
            if tensors is not None and fleet is not None and failed is None:
                try:
                    self.sender.add([p.name for p in bucket], tensors)
                except Exception as e:  # noqa: BLE001 - the gathers go on (every rank's)
                    failed = e
            del tensors
        try:
            if failed is not None:
                raise failed
            stats = self.sender.finish(version) if fleet is not None else None
        except BaseException:
            if fleet is not None:
                fleet.release_ahead()
                self.sender.abandon()
            raise
        written = time.perf_counter()

        def load_on_fleet() -> None:
            if fleet is None or meta is None:
                return
            try:
                fleet.update_from_file(meta, lambda: self.sender.full_file(version))
            except BaseException:
                self.sender.abandon()  # what the servers hold is not known now: full next
                raise

        run_on_main(load_on_fleet, f"loading weights version {version} on the fleet",
                    self.collective_timeout_s)
        engine.set_version(version)
        out = {"weight_sync/export_s": written - start,
               "weight_sync/load_s": time.perf_counter() - written}
        if stats is not None:
            out |= {"weight_sync/file_bytes": float(stats.file_bytes),
                    "weight_sync/file_ratio": stats.file_bytes / max(stats.raw_bytes, 1),
                    "weight_sync/changed_fraction": stats.changed_fraction,
                    "weight_sync/changed_tensors": float(stats.changed_tensors)}
        if fleet is not None:
            out |= fleet.last_timings
        return out

    def close(self) -> None:
        """Nothing held outside this process (the files stay for the servers)."""
