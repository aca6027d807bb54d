"""The trainer's side of the distributed weight transport (`rollout.weights.transport=
distributed`): weights go to the fleet over process groups, bucket by bucket, not via disk.

Every trainer rank runs `WeightBroadcaster.push`; rank 0 talks to the servers itself through
its `FleetUpdater` (engines/fleet/updater.py) and holds one process group per server (see
`engines.weight_transport.process_group_fleet`); the rollout controller is told only when the
update begins (it holds the fleet) and ends (the report). One update:
servers without a group join one (new, restarted or added servers: a log line names them), the
servers pause, then for each bucket every rank gathers the FSDP shards to full tensors (a
collective) while the servers post a receive, and rank 0 sends the bucket on each server's
group; the last bucket carries the version label; then the fleet continues. Rank 0 never holds
more than one gathered bucket.

Failure: a server that dies or fails mid-update is dropped from the broadcast (its group is
discarded; the others receive every bucket) and leaves service, paused, until a later
broadcast includes it. `rollout.weights.on_broadcast_failure=stop` then raises an error naming it;
`retry` goes on with the other servers. No server receiving the update always raises.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
import uuid
from typing import Any, Optional

import torch

from areal_like.api import TrainEngine, WeightUpdateMeta
from areal_like.api.config import RolloutConfig
from areal_like.api.io_struct import UpdateReport, WeightGroupSpec
from areal_like.runtime.main_rank import run_on_main, share_from_main
from engines.fleet.updater import FleetUpdater
from engines.weight_transport.process_group_trainer import (
    WeightUpdateGroup,
    default_backend,
    flatten_bucket,
    host_store,
    plan_buckets,
)

logger = logging.getLogger("areal_like")


class WeightBroadcastFailed(RuntimeError):
    """A distributed weight update failed (the message names the servers at fault)."""


class WeightBroadcaster:
    def __init__(self, config: RolloutConfig, collective_timeout_s: float = 600.0) -> None:
        self.config = config
        self.collective_timeout_s = collective_timeout_s
        self.groups: dict[str, WeightUpdateGroup] = {}  # rank 0: server -> its group
        self.formations = 0  # groups formed; once per server unless it fails or restarts
        self.backend = (default_backend() if config.weights.group_backend == "auto"
                        else config.weights.group_backend)
        self._store: Optional[Any] = None
        self._port = 0
        self._buffer: Optional[Any] = None  # rank 0: the largest bucket's bytes, reused
        # unique per broadcaster: a server that kept an earlier broadcaster's group (its
        # leave failed) refuses a second group of the same name
        self._group_prefix = f"areal_like_weights_{os.getpid()}_{uuid.uuid4().hex[:8]}"

    def push(self, engine: TrainEngine, fleet: Optional[FleetUpdater],
             version: int) -> dict[str, float]:
        """Send `engine`'s weights to the fleet as `version` (every rank calls this; rank 0
        passes its `fleet` updater). Returns timings."""
        start = time.perf_counter()
        buckets = plan_buckets(engine.weight_specs(),
                               int(self.config.weights.bucket_mb * 2**20))
        meta = WeightUpdateMeta.from_distributed(buckets, self._group_prefix, version)
        state: dict[str, Any] = {"error": None, "held": False, "members": (), "failed": {}}

        def guarded(step: Any) -> None:  # rank 0: an error of the trainer's own ends it
            if fleet is None or state["error"] is not None:
                return
            try:
                step()
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                state["error"] = f"{type(e).__name__}: {e}"

        def prepare() -> None:
            assert fleet is not None
            fleet.hold(version)
            state["held"] = True
            self._form(fleet, state["failed"])
            state["members"] = fleet.begin_weight_broadcast(meta)

        run_on_main(lambda: guarded(prepare), f"preparing weights version {version}",
                    self.collective_timeout_s)
        for index, tensors in enumerate(engine.iter_weight_buckets(buckets)):
            def send(index: int = index, tensors: Any = tensors) -> None:
                assert fleet is not None
                self._send_bucket(fleet, meta, state, index, tensors)

            run_on_main(functools.partial(guarded, send),
                        f"broadcasting weights version {version}", self.collective_timeout_s)
            del tensors
        run_on_main(lambda: self._finish(fleet, meta, state),
                    f"resuming the fleet with weights version {version}",
                    self.collective_timeout_s)
        error = share_from_main(self._verdict(state, version))
        if error is not None:
            raise WeightBroadcastFailed(error)
        engine.set_version(version)
        return {"weight_sync/broadcast_s": time.perf_counter() - start,
                "weight_sync/buckets": float(len(buckets))}

    # ---- rank 0 -------------------------------------------------------------------------
    def _form(self, fleet: FleetUpdater, failed: dict[str, str]) -> None:
        addr = self.config.weights.group_addr
        timeout = self.config.weights.broadcast_timeout
        if self._store is None:
            self._store, self._port = host_store(addr, timeout)
        spec = WeightGroupSpec(
            group_name=f"{self._group_prefix}_{self.formations}", master_addr=addr,
            master_port=self._port, backend=self.backend, timeout_s=timeout)
        layout = fleet.form_weight_group(spec, force=not self.groups)
        for server in [s for s in self.groups if s not in layout.members]:
            self._drop(server)
        if not layout.joining:
            failed.update(fleet.join_weight_group())
            return
        for server, _, _ in layout.joining:
            self._drop(server)
        joining = {server: WeightUpdateGroup(name, self._store, world, self.backend, timeout)
                   for server, name, world in layout.joining}
        with concurrent.futures.ThreadPoolExecutor(len(joining) + 1,
                                                   thread_name_prefix="weight-group") as pool:
            joined = pool.submit(fleet.join_weight_group)
            connects = {s: pool.submit(g.connect) for s, g in joining.items()}
            failed.update(joined.result())
            for server, future in connects.items():
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001 - that server is dropped, not the update
                    failed.setdefault(server, str(e))
                    continue
                if server not in failed:
                    self.groups[server] = joining[server]
                    self.formations += 1
        logger.info("weight-update groups (%s) joined by %s", self.backend,
                    ", ".join(s for s in joining if s in self.groups) or "no server")

    def _send_bucket(self, fleet: FleetUpdater, meta: WeightUpdateMeta, state: dict[str, Any],
                     index: int, tensors: list[Any]) -> None:
        members = tuple(s for s in state["members"]
                        if s not in state["failed"] and s in self.groups)
        if not members:
            return
        device = next(iter(self.groups.values())).device
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat = flatten_bucket(tensors, device, out=self._buffer)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-recv") as pool:
            received = pool.submit(fleet.receive_weight_bucket, meta, index, members)
            works = {}
            for server in members:
                try:
                    works[server] = self.groups[server].start_broadcast(flat)
                except Exception as e:  # noqa: BLE001
                    state["failed"][server] = f"{type(e).__name__}: {e}"
            for server, work in works.items():
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - that server's group is broken
                    state["failed"].setdefault(server, f"{type(e).__name__}: {e}"[:500])
            for server in list(state["failed"]):
                self._drop(server)  # the server's pending receive fails once its peer is gone
            for server, why in received.result().items():
                state["failed"].setdefault(server, why)

    def _finish(self, fleet: Optional[FleetUpdater], meta: WeightUpdateMeta,
                state: dict[str, Any]) -> None:
        """Continue the servers that received every bucket and release the fleet, whatever
        happened before: after an error of the trainer's own, every server of the broadcast
        is dropped (it may hold partial weights)."""
        if fleet is None or not state["held"]:
            return
        report = UpdateReport(meta)
        try:
            if state["error"] is None:
                received, dropped = fleet.end_weight_broadcast(meta, dict(state["failed"]))
            else:
                why = f"the trainer's broadcast failed ({state['error']})"
                received, dropped = [], {s: why for s in state["members"]} | state["failed"]
            for server, why in dropped.items():
                state["failed"].setdefault(server, why)
                self._drop(server)
            state["received"] = received
            report.loaded, report.failed = list(received), dict(state["failed"])
            report.advanced = bool(received)
        except Exception as e:  # noqa: BLE001 - reported on every rank (the fleet is released)
            state["error"] = state["error"] or f"{type(e).__name__}: {e}"
            report.failed = {s: f"the broadcast did not end: {state['error']}"
                             for s in state["members"]} | state["failed"]
        finally:
            try:
                fleet.release(report)
            except Exception as e:  # noqa: BLE001
                state["error"] = state["error"] or f"{type(e).__name__}: {e}"

    def _verdict(self, state: dict[str, Any], version: int) -> Optional[str]:
        if state["error"] is not None:
            return f"weights version {version}: {state['error']}"
        failed = state["failed"]
        named = "; ".join(f"{s}: {why}" for s, why in failed.items())
        if not state.get("received"):
            return f"weights version {version} reached no server ({named or 'none in service'})"
        if failed and self.config.weights.on_broadcast_failure == "stop":
            return (f"weights version {version} did not reach {len(failed)} server(s) "
                    f"(rollout.weights.on_broadcast_failure=stop): {named}")
        if failed:
            logger.warning("weights version %d went to %s; dropped: %s", version,
                           ", ".join(state["received"]), named)
        return None

    def _drop(self, server: str) -> None:
        group = self.groups.pop(server, None)
        if group is not None:
            group.destroy()

    def close(self) -> None:
        for server in list(self.groups):
            self._drop(server)
        self._store = None
        self._buffer = None
