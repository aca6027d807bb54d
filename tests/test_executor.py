"""WorkflowExecutor unit tests: staleness admission, errors, timeouts, pause/resume, lifecycle.

Uses the instant in-process engine from test_executor_fakes (a unit test of one component).
"""

from __future__ import annotations

import asyncio
import threading
import traceback

import pytest
from config_helpers import rollout_config
from test_executor_fakes import GroupWorkflow, InstantEngine, eventually, group_ids, items

from areal_like.api.trajectory import TrajectoryError
from areal_like.rollout import (
    ExecutorClosedError,
    NoTrajectoriesError,
    RolloutError,
    RolloutTimeoutError,
    RolloutWorkflowError,
    admission_capacity,
    is_stale,
    staleness_bound,
)


@pytest.fixture
def make_engine():
    engines: list[InstantEngine] = []

    def make(**cfg) -> InstantEngine:
        engine = InstantEngine(rollout_config(**cfg))
        engine.initialize()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()


def loader(n_batches: int, per_batch: int) -> list[list[dict]]:
    return [items(b * per_batch, (b + 1) * per_batch) for b in range(n_batches)]


def test_staleness_arithmetic():
    assert staleness_bound(eta=0, version=0, consumer_batch_size=4) == 4
    assert staleness_bound(eta=2, version=3, consumer_batch_size=4) == 24
    assert admission_capacity(2, 3, 4, accepted=20, running=3) == 1
    assert admission_capacity(0, 1, 4, accepted=8, running=0) == 0
    assert not is_stale(None, 10, 0)  # nothing trained on: never stale
    assert is_stale(1, 2, 0) and not is_stale(2, 2, 0)
    assert not is_stale(0, 2, 2) and is_stale(0, 3, 2)


@pytest.mark.parametrize("eta", [0, 2])
def test_admission_never_exceeds_bound(make_engine, eta):
    batch_size, steps = 2, 6
    engine = make_engine(max_head_offpolicyness=eta, consumer_batch_size=batch_size,
                         max_concurrent_rollouts=64)
    ex = engine.executor
    violations: list[str] = []

    def on_start(data: dict) -> None:  # runs on the loop thread right after admission
        s = ex.stats()
        bound = staleness_bound(eta, s["version"], batch_size)
        if s["staleness_accepted"] + s["running"] > bound:
            violations.append(f"{s['staleness_accepted']} + {s['running']} > {bound}")

    wf = GroupWorkflow(n=2, max_sleep=0.003, on_start=on_start)
    data = loader(40, 2)
    staleness_seen: list[int] = []
    for step in range(steps):
        batch = ex.prepare_batch(data, wf)
        assert len(group_ids(batch)) == batch_size
        trained = batch["versions"][batch["loss_mask"]]
        staleness = step - int(trained.min())
        staleness_seen.append(staleness)
        assert 0 <= staleness <= eta
        if eta == 0:  # synchronous semantics: every trained token from the current policy
            assert (trained == step).all()
        s = ex.stats()
        assert s["last_batch"]["staleness_max"] == staleness
        assert s["staleness_accepted"] + s["running"] <= staleness_bound(eta, step, batch_size)
        engine.set_version(step + 1)
    assert not violations, violations
    if eta == 2:  # the rollout really ran ahead of the trainer
        assert max(staleness_seen) > 0
    s = ex.stats()
    assert s["consumed"] == steps * batch_size
    if eta == 0:  # exactly B groups are admitted per version, all consumed at that version
        assert s["dropped_stale"] == 0


def test_stale_groups_are_dropped_and_counted(make_engine):
    engine = make_engine(max_head_offpolicyness=0, consumer_batch_size=2,
                         max_concurrent_rollouts=16)
    ex = engine.executor
    gate = threading.Event()
    wf = GroupWorkflow(n=2, gate=gate)
    for item in items(0, 4):
        ex.submit(item, wf)
    # 2 groups x 2 samples generated at version 0, then held at the gate
    eventually(lambda: engine.requests == 4, what="2 groups generated at version 0")
    s = ex.stats()
    assert s["running"] == 2 and s["queued"] == 2  # the bound (0 + 0 + 1) * 2 holds back 2
    engine.set_version(1)
    eventually(lambda: engine.requests == 8, what="2 more groups generated at version 1")
    gate.set()
    eventually(lambda: ex.stats()["completed"] == 4, what="all 4 episodes finished")
    batch = ex.wait(2, timeout=10)  # drops the 2 stale groups, returns the 2 fresh ones
    assert sorted(group_ids(batch)) == [2, 3]
    assert (batch["versions"][batch["loss_mask"]] == 1).all()
    s = ex.stats()
    assert s["dropped_stale"] == 2 and s["accepted"] == 4 and s["consumed"] == 2
    assert s["staleness_accepted"] == 2  # dropped groups gave their budget back


def test_consumption_drops_by_the_trainers_version_while_the_fleet_loads(make_engine):
    """A weight load beside training (`rollout.weights.overlap_load`): the trainer holds
    version 2 (its update begun) while the fleet still serves 1. No batch may hold a token
    more than eta versions older than the weights that train on it, so groups of version 0
    are dropped at eta = 1 although the fleet's own version would keep them."""
    engine = make_engine(max_head_offpolicyness=1, consumer_batch_size=2,
                         max_concurrent_rollouts=16)
    ex, wf = engine.executor, GroupWorkflow(n=2)
    for item in items(0, 6):
        ex.submit(item, wf)
    # the bound (1 + 0 + 1) * 2 admits 4 at version 0 and holds back 2
    eventually(lambda: ex.stats()["completed"] == 4, what="4 groups generated at version 0")
    engine.set_version(1)  # the fleet: the next 2 are generated by version 1
    engine.updating_to = 2  # the trainer: version 2, the fleet still loading it
    batch = ex.wait(2, timeout=10)
    assert sorted(group_ids(batch)) == [4, 5]
    assert (batch["versions"][batch["loss_mask"]] == 1).all()
    assert ex.stats()["dropped_stale"] == 4  # version 0: 2 behind the trainer, 1 behind the fleet


def test_a_run_that_starts_at_a_later_version_gets_the_same_bound(make_engine):
    """The fleet is at version 5 when the run begins (a restarted job, a shared fleet): the
    bound counts versions from the first admission, so (eta + 1) * B groups run ahead, not
    (eta + 5 + 1) * B, and an 8-item epoch is not wrapped into the first two batches."""
    eta, batch_size = 1, 2
    engine = make_engine(max_head_offpolicyness=eta, consumer_batch_size=batch_size,
                         max_concurrent_rollouts=64)
    engine.set_version(5)
    ex, wf, data = engine.executor, GroupWorkflow(n=2), loader(4, 2)  # items 0..7: one epoch
    assert group_ids(ex.prepare_batch(data, wf)) == [0, 1]
    assert group_ids(ex.prepare_batch(data, wf)) == [2, 3]  # still version 5
    s = ex.stats()
    assert s["accepted"] == s["consumed"] == (eta + 1) * batch_size and s["running"] == 0
    assert s["submitted"] == (eta + 2) * batch_size  # the bound + one batch of slack drawn
    state = ex.state_dict()
    assert state["start_version"] == 5 and state["data_position"]["epoch"] == 0
    engine.set_version(6)
    assert group_ids(ex.prepare_batch(data, wf)) == [4, 5]


def test_the_bound_starts_at_the_first_admission_not_the_first_queued_item(make_engine):
    """Bounded items queued while every slot is taken (by a synchronous rollout_batch) are
    first admitted at version 3: the bound counts from there, so (eta + 1) * B = 4 groups are
    admitted, not (eta + 3 + 1) * B = 7."""
    engine = make_engine(max_head_offpolicyness=3, consumer_batch_size=1,
                         max_concurrent_rollouts=1)
    ex, gate, synced = engine.executor, threading.Event(), []
    sync = threading.Thread(target=lambda: synced.append(
        ex.rollout_batch(items(0, 1), GroupWorkflow(gate=gate))))
    ex.pause()  # everything queued first, so one admission at version 0 sees it all
    sync.start()
    try:
        eventually(lambda: ex.stats()["queued"] == 1, what="rollout_batch queued")
        for item in items(1, 9):
            ex.submit(item, GroupWorkflow())
        ex.resume()
        # the synchronous item takes the one slot; the bounded ones wait for it
        eventually(lambda: ex.stats()["running"] == 1, what="rollout_batch holds the slot")
        engine.set_version(3)
    finally:
        gate.set()
        sync.join(30)
    assert group_ids(synced[0]) == [0]
    assert group_ids(ex.wait(4, timeout=10)) == [1, 2, 3, 4]
    assert ex.state_dict()["start_version"] == 3
    s = ex.stats()
    assert (s["capacity"], s["running"], s["queued"]) == (0, 0, 4), s


def test_workflow_exception_reaches_wait_with_id_and_traceback(make_engine):
    engine = make_engine(max_head_offpolicyness=10, consumer_batch_size=1)
    ex = engine.executor
    for item in items(0, 5):
        ex.submit(item, GroupWorkflow(fail_ids=(3,)))
    with pytest.raises(RolloutWorkflowError) as info:
        ex.wait(5, timeout=10)
    err = info.value
    assert "id=3" in str(err) and "boom on item 3" in str(err) and err.data_id == "3"
    assert isinstance(err.__cause__, ValueError)
    frames = [f.name for f in traceback.extract_tb(err.__cause__.__traceback__)]
    assert "arun_episode" in frames
    assert "boom on item 3" in "".join(traceback.format_exception(err))
    # the executor keeps serving the other items
    assert sorted(group_ids(ex.wait(4, timeout=10))) == [0, 1, 2, 4]
    assert ex.stats()["failed"] == 1


def test_invalid_trajectory_names_the_key(make_engine):
    class NoRewards(GroupWorkflow):
        async def arun_episode(self, engine, data):
            td = await super().arun_episode(engine, data)
            del td["rewards"]
            return td

    ex = make_engine(max_head_offpolicyness=10).executor
    ex.submit(items(0, 1)[0], NoRewards())
    with pytest.raises(RolloutWorkflowError, match="rewards") as info:
        ex.wait(1, timeout=10)
    assert isinstance(info.value.__cause__, TrajectoryError)


def test_always_rejecting_filter_times_out_with_counts(make_engine):
    ex = make_engine(max_head_offpolicyness=10, consumer_batch_size=2).executor
    for item in items(0, 5):
        ex.submit(item, GroupWorkflow(), should_accept=lambda td: False)
    eventually(lambda: ex.stats()["completed"] == 5, what="5 episodes finished")
    with pytest.raises(RolloutTimeoutError) as info:
        ex.wait(1, timeout=0.2)
    msg = str(info.value)
    assert isinstance(info.value, TimeoutError)
    for part in ("0 of 1 groups ready", "produced 5 episodes", "rejected 5",
                 "5 by should_accept", "still running 0", "queued 0",
                 "nothing is running or queued"):
        assert part in msg, (part, msg)


def test_prepare_batch_with_rejecting_filter_does_not_hang(make_engine):
    ex = make_engine(max_head_offpolicyness=0, consumer_batch_size=2).executor
    with pytest.raises(RolloutTimeoutError, match="by should_accept"):
        ex.prepare_batch(loader(3, 2), GroupWorkflow(), lambda td: False, timeout=3.0)
    assert ex.stats()["rejected_by_filter"] > 6  # it cycled the 6-item loader


def test_dynamic_sampling_filter(make_engine):
    ex = make_engine(max_head_offpolicyness=1, consumer_batch_size=3).executor
    odd_only = lambda td: bool(td["rewards"][0] == 1.0)  # noqa: E731
    batch = ex.prepare_batch(loader(10, 2), GroupWorkflow(), odd_only)
    assert all(i % 2 == 1 for i in group_ids(batch)) and len(group_ids(batch)) == 3
    assert ex.stats()["rejected_by_filter"] >= 3


def test_pause_and_resume(make_engine):
    ex = make_engine(max_head_offpolicyness=10, consumer_batch_size=1).executor
    gate = threading.Event()
    wf = GroupWorkflow(gate=gate)
    ex.submit(items(0, 1)[0], wf)
    ex.submit(items(1, 2)[0], wf)
    eventually(lambda: ex.stats()["running"] == 2)
    ex.pause()
    ex.submit(items(2, 3)[0], wf)
    gate.set()  # in-flight episodes finish while paused
    assert sorted(group_ids(ex.wait(2, timeout=10))) == [0, 1]
    with pytest.raises(RolloutTimeoutError, match="paused"):
        ex.wait(1, timeout=0.2)
    s = ex.stats()
    assert s["running"] == 0 and s["queued"] == 1 and s["paused"]
    ex.resume()
    assert group_ids(ex.wait(1, timeout=10)) == [2]


def test_staleness_block_hint(make_engine):
    ex = make_engine(max_head_offpolicyness=0, consumer_batch_size=1).executor
    for item in items(0, 2):
        ex.submit(item, GroupWorkflow())
    with pytest.raises(RolloutTimeoutError, match="blocked by the staleness bound"):
        ex.wait(2, timeout=0.3)  # version never advances: only one group may be admitted


def test_rollout_batch_order_bypass_and_errors(make_engine):
    ex = make_engine(max_head_offpolicyness=0, consumer_batch_size=1,
                     max_concurrent_rollouts=4).executor
    wf = GroupWorkflow(max_sleep=0.005)
    batch = ex.rollout_batch(items(0, 9), wf)  # 9 > the staleness bound of 1: bypassed
    assert group_ids(batch) == list(range(9)) and batch.batch_size[0] == 18
    # rows of a group stay together and in sample order (sample i has 2 + i + id % 3 tokens)
    expected_lengths = [2 + i + k % 3 for k in range(9) for i in range(2)]
    assert batch["loss_mask"].sum(1).tolist() == expected_lengths
    assert ex.stats()["staleness_accepted"] == 0
    with pytest.raises(RolloutWorkflowError, match="id=4"):
        ex.rollout_batch(items(0, 6), GroupWorkflow(fail_ids=(4,)))
    with pytest.raises(NoTrajectoriesError, match="should_accept"):
        ex.rollout_batch(items(0, 3), wf, should_accept=lambda td: False)


def test_loop_thread_error_surfaces(make_engine, monkeypatch):
    ex = make_engine().executor

    def broken(version):
        raise RuntimeError("admission bug")

    monkeypatch.setattr(ex._state, "admit", broken)
    with pytest.raises(RolloutError, match="event-loop thread failed") as info:
        ex.submit(items(0, 1)[0], GroupWorkflow())
        ex.wait(1, timeout=10)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_run_coroutine_on_the_loop(make_engine):
    ex = make_engine().executor

    async def which_loop():
        import asyncio
        return asyncio.get_running_loop()

    async def sleeper():
        import asyncio
        await asyncio.sleep(30)

    async def fails():
        raise KeyError("inside")

    assert ex.run_coroutine(which_loop(), timeout=5) is ex.loop
    with pytest.raises(TimeoutError, match="did not finish"):
        ex.run_coroutine(sleeper(), timeout=0.1)
    with pytest.raises(KeyError, match="inside"):
        ex.run_coroutine(fails(), timeout=5)


def test_destroy_cancels_and_wakes_waiters():
    engine = InstantEngine(rollout_config(max_head_offpolicyness=10))
    engine.initialize()
    ex = engine.executor
    gate = threading.Event()
    for item in items(0, 3):
        ex.submit(item, GroupWorkflow(gate=gate))
    eventually(lambda: ex.stats()["running"] == 3)
    errors: list[BaseException] = []

    def waiter():
        try:
            ex.wait(3, timeout=30)
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    engine.destroy()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ExecutorClosedError)
    assert ex.stats()["cancelled"] == 3
    engine.destroy()  # twice is fine
    with pytest.raises(ExecutorClosedError):
        ex.submit(items(0, 1)[0], GroupWorkflow())


def test_blocking_call_inside_a_workflow_is_an_error(make_engine):
    class WaitsInside(GroupWorkflow):
        async def arun_episode(self, engine, data):
            return engine.executor.wait(1, timeout=1)

    ex = make_engine(max_head_offpolicyness=10).executor
    ex.submit(items(0, 1)[0], WaitsInside())
    with pytest.raises(RolloutWorkflowError, match="deadlock"):
        ex.wait(1, timeout=10)


class HoldItem(GroupWorkflow):
    """GroupWorkflow whose episode of item `held` waits (after generating) for `release`."""

    def __init__(self, held: int, release: threading.Event) -> None:
        super().__init__(n=2)
        self.held, self.release = held, release

    async def arun_episode(self, engine, data):
        traj = await super().arun_episode(engine, data)
        while data["id"] == self.held and not self.release.is_set():
            await asyncio.sleep(0.002)
        return traj


def test_a_slow_group_is_waited_for_when_it_would_go_stale(make_engine):
    # eta 1, B 1: items 0 (held) and 1 are admitted at version 0. Item 1 is trained at
    # version 0; at version 1 item 0 is due (stale at version 2), so the batch waits for it
    # rather than taking the newer item 2 and later dropping the long one.
    engine = make_engine(max_head_offpolicyness=1, consumer_batch_size=1,
                         max_concurrent_rollouts=16)
    ex = engine.executor
    release = threading.Event()
    wf = HoldItem(held=0, release=release)
    for item in items(0, 2):
        ex.submit(item, wf)
    assert group_ids(ex.wait(1, timeout=10)) == [1]
    engine.set_version(1)
    ex.submit(items(2, 3)[0], wf)
    eventually(lambda: ex.stats()["buffered"] == 1, what="item 2 finished at version 1")
    with pytest.raises(RolloutTimeoutError, match=r"waits for submission\(s\) #\[0\]"):
        ex.wait(1, timeout=0.2)  # item 2 is ready, but item 0 must go first
    release.set()
    batch = ex.wait(1, timeout=10)
    assert group_ids(batch) == [0]
    assert (batch["versions"][batch["loss_mask"]] == 0).all()  # staleness 1 <= eta
    engine.set_version(2)
    assert group_ids(ex.wait(1, timeout=10)) == [2]
    s = ex.stats()
    assert s["dropped_stale"] == 0 and s["consumed"] == 3
