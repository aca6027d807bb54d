"""The fleet client's side of a weight update that trainer rank 0 drives (`FleetMembership.
hold_for_update` / `end_update`), on the client's real membership and backend APIs, no server:
what the hold blocks, what a report does to the servers and the version, a trainer that never
ends its update, and the trainer's updater asking for the hold while it exports. (Against real
servers: tests/test_weight_broadcast.py, test_faults.py's killed-during-update test, and every
RL run, whose hold is asked ahead: tests/test_recipes.py checks its timings.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
from config_helpers import rollout_config

from areal_like.api.io_struct import AdapterWeights, FleetView, UpdateReport, WeightUpdateMeta
from engines.fleet.backends import server_api
from engines.fleet.membership import FleetMembership
from engines.fleet.routing import OwnAborts, ServerPool
from engines.fleet.updater import FleetUpdater

SERVERS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]


def _membership(backend: str = "sglang") -> FleetMembership:
    pool = ServerPool(list(SERVERS))
    membership = FleetMembership(rollout_config(backend=backend), pool, session=_no_session,
                                 on_fatal=pytest.fail, api=server_api(backend, ""),
                                 own_aborts=OwnAborts())
    membership._lock = asyncio.Lock()  # start() without its watch task: nothing to probe
    return membership


def _no_session():
    raise AssertionError("no HTTP call is expected here")


def test_a_disk_report_takes_the_failed_out_and_moves_the_version():
    async def run() -> None:
        m = _membership()
        m.pool.take_out(SERVERS[2], "dead")
        view = await m.hold_for_update(4, "retract", expires_s=60)
        assert view.version == 4 and view.in_service == tuple(SERVERS[:2])
        assert "127.0.0.1:3" in view.out_of_service
        assert m.lock().locked()  # no readmission until the update ends
        meta = WeightUpdateMeta.from_disk("/w/v4", 4)
        assert m.end_update(UpdateReport(meta, loaded=[SERVERS[0]],
                                         failed={SERVERS[1]: "refused"}, advanced=True))
        assert not m.lock().locked()
        assert m.pool.in_service() == [SERVERS[0]] and m.current is meta
        assert "failed to load weights version 4: refused" in m.pool.out_of_service[SERVERS[1]]

    asyncio.run(run())


def test_a_refused_update_leaves_the_version():
    async def run() -> None:
        m = _membership()
        before = WeightUpdateMeta.from_disk("/w/v3", 3)
        m.current = before
        await m.hold_for_update(4, "retract", expires_s=60)
        failed = {a: "bad weights" for a in SERVERS}
        assert m.end_update(UpdateReport(WeightUpdateMeta.from_disk("/w/v4", 4), failed=failed))
        assert m.current is before and m.pool.in_service() == []

    asyncio.run(run())


def test_a_broadcast_report_readmits_the_joined_and_parks_the_dropped():
    async def run() -> None:
        m = _membership()
        m.await_broadcast(SERVERS[2], "restarted")
        view = await m.hold_for_update(5, "retract", expires_s=60)
        assert view.awaiting_broadcast == (SERVERS[2],)
        meta = WeightUpdateMeta(version=5, type="distributed", buckets=((),), group_name="g")
        m.end_update(UpdateReport(meta, loaded=[SERVERS[0], SERVERS[2]],
                                  failed={SERVERS[1]: "gloo: connection closed"}, advanced=True))
        assert sorted(m.pool.in_service()) == [SERVERS[0], SERVERS[2]]
        assert m.awaiting_broadcast == {SERVERS[1]}  # paused until a later broadcast
        assert "dropped from the update to weights version 5 (gloo" in \
            m.pool.out_of_service[SERVERS[1]]

    asyncio.run(run())


def test_a_pause_that_aborts_counts_its_aborts_as_the_clients_own_until_the_end():
    async def run() -> None:
        m = _membership("vllm")  # vLLM's retract aborts requests: the client continues them
        epoch = m.own_aborts.epoch
        await m.hold_for_update(1, "retract", expires_s=60)
        assert m.own_aborts.ours(epoch) and m.own_aborts.pausing == 1
        adapter = AdapterWeights(tensors={}, config={})
        m.end_update(UpdateReport(WeightUpdateMeta.from_adapter(adapter, 1),
                                  loaded=list(SERVERS), advanced=True))
        assert m.own_aborts.pausing == 0
        # requests sent after the hold ended are not ours
        assert not m.own_aborts.ours(m.own_aborts.epoch)

    asyncio.run(run())


def test_an_update_the_trainer_never_ends_is_released_and_its_servers_leave():
    async def run() -> None:
        m = _membership("vllm")
        await m.hold_for_update(7, "retract", expires_s=0.05)
        async with asyncio.timeout(30):  # the expiry fires on the loop
            while m.lock().locked():
                await asyncio.sleep(0.01)
        assert m.pool.in_service() == [] and m.own_aborts.pausing == 0
        assert "did not finish its update to weights version 7" in \
            m.pool.out_of_service[SERVERS[0]]
        # the late end is refused: it would advance a fleet that has moved on
        meta = WeightUpdateMeta.from_disk("/w/v7", 7)
        assert not m.end_update(UpdateReport(meta, loaded=list(SERVERS), advanced=True))
        assert m.current is None

    asyncio.run(run())


def test_a_long_hold_is_said_until_it_ends(monkeypatch, caplog):
    monkeypatch.setattr("engines.fleet.membership.HELD_REMINDER_S", 0.02)

    def reminders() -> int:
        return sum("has been held" in r.getMessage() for r in caplog.records)

    async def run() -> None:
        m = _membership()
        await m.hold_for_update(3, "retract", expires_s=600)
        async with asyncio.timeout(30):
            while reminders() < 2:  # said again while it lasts
                await asyncio.sleep(0.01)
        assert "weights version 3 (readmissions wait for it)" in caplog.text
        assert m.end_update(UpdateReport(WeightUpdateMeta.from_disk("/w/v3", 3)))
        said = reminders()
        await asyncio.sleep(0.2)  # ten reminder periods: none comes after the release
        assert reminders() == said and not m.lock().locked()

    with caplog.at_level("WARNING", logger="engines.fleet.client"):
        asyncio.run(run())


class _AnsweringCoordinator:
    """The rollout side of the updater, recorded; its hold answers when the test says so
    (a stand-in for the rollout process's turn on a busy core)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.asked = threading.Event()
        self.answer = threading.Event()

    def begin_weight_update(self, version: int, pause_mode: str) -> FleetView:
        self.calls.append(("begin", version, threading.current_thread().name))
        self.asked.set()
        assert self.answer.wait(30), "the test never let the hold answer"
        return FleetView(version=version, in_service=())  # no server: no HTTP call

    def end_weight_update(self, report: UpdateReport) -> None:
        self.calls.append(("end", report.meta.version, report.advanced))


def test_a_hold_asked_ahead_is_answered_during_the_export_and_given_back_if_it_fails():
    coordinator = _AnsweringCoordinator()
    updater = FleetUpdater(rollout_config(), coordinator)  # type: ignore[arg-type]
    try:
        meta = WeightUpdateMeta.from_disk("/w/v1", 1)
        updater.hold_ahead(meta)  # returns at once: asked from the updater's own thread
        assert coordinator.asked.wait(30) and coordinator.calls[0][:2] == ("begin", 1)
        assert coordinator.calls[0][2] != threading.current_thread().name
        coordinator.answer.set()  # answered while "the export runs"
        updater.update_weights(meta)  # takes that hold: no second begin
        assert [c[:2] for c in coordinator.calls] == [("begin", 1), ("end", 1)]
        assert coordinator.calls[-1] == ("end", 1, True)
        assert set(updater.last_timings) == {"weight_sync/hold_s", "weight_sync/servers_s"}

        # the export of version 2 fails: the hold is ended with nothing loaded
        coordinator.calls.clear()
        failed = WeightUpdateMeta.from_disk("/w/v2", 2)
        updater.hold_ahead(failed)
        updater.release_ahead()
        assert coordinator.calls[1:] == [("end", 2, False)]
        # an update of another meta than the one held ahead releases that hold first
        coordinator.calls.clear()
        updater.hold_ahead(WeightUpdateMeta.from_disk("/w/v3", 3))
        updater.update_weights(WeightUpdateMeta.from_disk("/w/v3b", 3))
        assert [c[:2] for c in coordinator.calls] == [("begin", 3), ("end", 3), ("begin", 3),
                                                       ("end", 3)]
    finally:
        updater.close()
