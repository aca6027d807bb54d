"""Trainer rank 0's own client for weight updates: it pauses, loads and continues the servers
itself over HTTP, as slime's trainer drives its engines, instead of forwarding each step
through the rollout controller's process.

The fleet's client (`coordinator`: the rollout controller, usually in a process of its own)
keeps membership and the executor, and is told twice per update, whatever the transport:
`begin_weight_update` holds the fleet (pinned work finishes, no server is readmitted, the
aborts our pauses cause are continued) and names the servers (`FleetView`), asked for while
the trainer exports a folder (`hold_ahead`: the rollout process's turn, on a core it shares
with servers, is then off the update's path); `end_weight_update` gets the `UpdateReport`
(servers that failed leave service, the version moves), one-way through the rollout process.
Everything between is HTTP from here: one folder or adapter load per server (`update_weights`),
or the distributed transport's group calls, bucket by bucket
(`areal_like.runtime.weight_broadcast` drives them; the groups live here, beside the trainer's
ends of them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Coroutine
from typing import Any, Callable, Optional, TypeVar

import aiohttp

from areal_like.api.config import RolloutConfig
from areal_like.api.engine_api import FleetClient
from areal_like.api.io_struct import (
    FleetView,
    UpdateReport,
    WeightGroupLayout,
    WeightGroupSpec,
    WeightUpdateMeta,
)
from areal_like.utils.loop_thread import EventLoopThread
from engines.fleet.backends import server_api
from engines.fleet.updates import refused_everywhere, update_each
from engines.server.http import CONTROL_TIMEOUT_S, open_session
from engines.weight_transport.delta_fleet import FleetDeltaLoader
from engines.weight_transport.process_group_fleet import PROBE_TIMEOUT_S, FleetWeightGroup

T = TypeVar("T")

RETRACT = "retract"  # how a broadcast pauses the servers: requests are kept, not lost


class FleetUpdater:
    """Loads new weights on the servers `coordinator` names, over an HTTP session of its own
    (`config.client.api_key`, `config.weights` timeouts)."""

    def __init__(self, config: RolloutConfig, coordinator: FleetClient) -> None:
        self.config = config
        self.coordinator = coordinator
        self.api = server_api(config.backend or "sglang", config.lora_adapter)
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop = EventLoopThread("weight-updater")
        self._loop.start()
        try:
            self._loop.run_coroutine(self._open_session(), CONTROL_TIMEOUT_S)
        except BaseException:
            self._loop.stop()
            raise
        self.weight_group = FleetWeightGroup(config, self._require_session, self.api)
        self.delta_loader = FleetDeltaLoader(config, self._require_session, self.api)
        self._view: Optional[FleetView] = None  # of the broadcast under way
        # where the last folder or adapter update spent its time (metrics, seconds): waiting
        # for the fleet's hold (what the export did not cover, see `hold_ahead`), then the
        # servers' pause -> load -> continue
        self.last_timings: dict[str, float] = {}
        # a hold asked for ahead of its update (`hold_ahead`): the update, the answer to come
        self._ahead: Optional[tuple[WeightUpdateMeta, concurrent.futures.Future[FleetView]]] = None
        self._asker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-hold")
        # a load beside training (`start_update`): HTTP calls only, off the trainer's thread
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-load")

    async def _open_session(self) -> None:
        self._session = open_session(self.config.client.api_key)

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("FleetUpdater is closed")
        return self._session

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self._loop.run_coroutine(coro, timeout)

    # ---- a folder or an adapter, loaded by each server ----------------------------------
    def hold_ahead(self, meta: WeightUpdateMeta) -> None:
        """Ask the coordinator to hold the fleet for `meta` now, before the trainer has
        exported it: the answer (a turn of the rollout process, whose core the servers share)
        comes while the export runs. `update_weights(meta)` takes it; `release_ahead` gives it
        back when the update does not happen (the export failed)."""
        self.release_ahead()
        self._ahead = (meta, self._asker.submit(self.coordinator.begin_weight_update,
                                                meta.version, self.api.update_pause_mode))

    def release_ahead(self) -> None:
        """End a hold asked for ahead, with nothing loaded (the version does not move)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        meta, answer = ahead
        if answer.exception(timeout=self._two_loads_s()) is None:  # held: release it
            self.coordinator.end_weight_update(UpdateReport(meta))

    @property
    def update_bound_s(self) -> float:
        """How long a `start_update` future may take at most (its load, then its end)."""
        return self._two_loads_s() + 2 * CONTROL_TIMEOUT_S

    def _two_loads_s(self) -> float:
        """The bound on a hold (pinned work, then a readmission's load may come first) and
        on an update (a load, then the answer probes of a fleet-wide failure)."""
        return 2 * self.config.weights.update_timeout + 4 * CONTROL_TIMEOUT_S

    def _hold(self, meta: WeightUpdateMeta) -> FleetView:
        ahead = self._ahead
        if ahead is not None and ahead[0] is meta:
            self._ahead = None
            return ahead[1].result(timeout=self._two_loads_s())
        self.release_ahead()
        return self.coordinator.begin_weight_update(meta.version, self.api.update_pause_mode)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Pause -> load `meta` -> continue on every server in service, each on its own; the
        servers that fail leave service. Raises when none loaded it and one that still answers
        refused it (the version then does not move)."""
        self._load_held(meta, *self._take_hold(meta))

    def start_update(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """`update_weights(meta)` beside the caller's work: the fleet's hold is taken here
        (so the coordinator hears of the update before any later call of the caller's), the
        load and the continue run in the updater's own thread; the future raises what
        `update_weights` would. One at a time: wait for it before the next update."""
        return self._loader.submit(self._load_held, meta, *self._take_hold(meta))

    def _take_hold(self, meta: WeightUpdateMeta) -> tuple[FleetView, float]:
        """The fleet held for `meta` (a folder or an adapter), and how long that took."""
        if meta.type == "distributed":
            raise ValueError("WeightUpdateMeta(type='distributed') is broadcast bucket by bucket: "
                             "see areal_like.runtime.weight_broadcast")
        start = time.perf_counter()
        return self._hold(meta), time.perf_counter() - start

    def _load_held(self, meta: WeightUpdateMeta, view: FleetView, held_s: float) -> None:
        self._drive(meta, view, held_s, lambda report: self._load(view, meta, report))

    def _drive(self, meta: WeightUpdateMeta, view: FleetView, held_s: float,
               load: Callable[[UpdateReport], Coroutine[Any, Any, Optional[Exception]]]
               ) -> None:
        """Run `load` (it fills the report) on the updater's loop; the coordinator gets the
        report whatever happens (servers not reached count as failed). Raises what `load`
        returns: every server refused the weights."""
        held = time.perf_counter()
        report = UpdateReport(meta)
        refused = None
        try:
            refused = self._run(load(report), self._two_loads_s())
            self.last_timings = {"weight_sync/hold_s": held_s,
                                 "weight_sync/servers_s": time.perf_counter() - held}
        except BaseException as e:
            unfinished = f"the update did not finish ({type(e).__name__}: {e})"
            report.failed |= {a: unfinished for a in view.in_service
                              if a not in report.loaded and a not in report.failed}
            report.advanced = False
            raise
        finally:
            self.coordinator.end_weight_update(report)
        if refused is not None:
            raise refused

    async def _load(self, view: FleetView, meta: WeightUpdateMeta,
                    report: UpdateReport) -> Optional[Exception]:
        targets = list(view.in_service)
        session = self._require_session()
        failed = await update_each(session, self.api, targets, meta,
                                   self.config.weights.update_timeout)
        return await self._reported(targets, failed, meta, report)

    async def _reported(self, targets: list[str], failed: dict[str, BaseException],
                        meta: WeightUpdateMeta, report: UpdateReport) -> Optional[Exception]:
        """`report` of an update of `targets`; the error to raise when every one refused."""
        report.loaded = [a for a in targets if a not in failed]
        report.failed = {a: str(e) for a, e in failed.items()}
        refused = await refused_everywhere(self._require_session(), self.api, targets, failed,
                                           meta.version)
        report.advanced = refused is None
        return refused

    # ---- the delta transport (see areal_like.runtime.weight_delta) ----------------------
    def update_from_file(self, meta: WeightUpdateMeta, full_file: Callable[[], str]) -> None:
        """Apply the weight file `meta` names on every server in service and on those
        awaiting the trainer's next update that answer (restarted, added: they get the full
        file, `full_file()` writes it); the servers that fail leave service until a later
        update includes them. Raises when none applied it and one that answers refused it."""
        if meta.type != "delta":
            raise ValueError(f"update_from_file takes WeightUpdateMeta(type='delta'), got "
                             f"{meta.type!r}")
        held_since = time.perf_counter()
        view = self._hold(meta)
        try:
            self._drive(meta, view, time.perf_counter() - held_since,
                        lambda report: self._apply_file(view, meta, full_file, report))
        finally:
            self.last_timings |= self.delta_loader.stats()

    async def _apply_file(self, view: FleetView, meta: WeightUpdateMeta,
                          full_file: Callable[[], str],
                          report: UpdateReport) -> Optional[Exception]:
        session = self._require_session()
        answers = await asyncio.gather(*(self.api.answers(session, a, PROBE_TIMEOUT_S)
                                         for a in view.awaiting_broadcast))
        waiting = [a for a, why in zip(view.awaiting_broadcast, answers, strict=True)
                   if not why]
        targets = sorted(set(view.in_service) | set(waiting))
        failed = await self.delta_loader.update(targets, meta, full_file)
        return await self._reported(targets, failed, meta, report)

    # ---- the distributed transport (see areal_like.runtime.weight_broadcast) ------------
    def hold(self, version: int) -> FleetView:
        """Begin a broadcast of `version`: the coordinator holds the fleet."""
        self._view = self.coordinator.begin_weight_update(version, RETRACT)
        return self._view

    def release(self, report: UpdateReport) -> None:
        """End it: the coordinator applies `report` and releases the fleet."""
        self._view = None
        self.coordinator.end_weight_update(report)

    def _group_call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._run(coro, self.config.weights.update_timeout + 2 * CONTROL_TIMEOUT_S)

    def form_weight_group(self, spec: WeightGroupSpec, force: bool = False) -> WeightGroupLayout:
        """Which servers receive the broadcast; those without a group start joining one."""
        if self._view is None:
            raise RuntimeError("form_weight_group before hold(version)")
        return self._group_call(self.weight_group.form(spec, self._view, force))

    def join_weight_group(self) -> dict[str, str]:
        """Wait for the servers asked to join; returns those that failed, and why."""
        return self._group_call(self.weight_group.join())

    def begin_weight_broadcast(self, meta: WeightUpdateMeta) -> tuple[str, ...]:
        """Pause the members (requests retracted); returns those that will receive it."""
        return self._group_call(self.weight_group.begin(meta))

    def receive_weight_bucket(self, meta: WeightUpdateMeta, index: int,
                              members: tuple[str, ...]) -> dict[str, str]:
        """Each of `members` receives bucket `index` (blocks while the trainer sends it);
        returns those that failed, and why."""
        return self._group_call(self.weight_group.receive(meta, index, members))

    def end_weight_broadcast(self, meta: WeightUpdateMeta,
                             failed: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The members not in `failed` serve `meta.version` and continue; returns them, and
        every server dropped (and why)."""
        return self._group_call(self.weight_group.end(meta, failed))

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Leave every weight-update group and close the session; safe to call twice."""
        if self._session is None:
            return
        try:
            self.release_ahead()
            self._asker.shutdown()
            self._loader.shutdown()  # waits for a load under way (bounded by its own timeout)
            self._run(self.weight_group.dissolve(), 2 * CONTROL_TIMEOUT_S)
        finally:
            session, self._session = self._session, None
            try:
                self._run(session.close(), CONTROL_TIMEOUT_S)
            finally:
                self._loop.stop()
