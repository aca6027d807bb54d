"""Exact resume: executor state_dict round trip and the resumable dataloader cursor."""

from __future__ import annotations

import io
import random
import threading

import pytest
import torch
from config_helpers import rollout_config
from test_executor_fakes import GroupWorkflow, InstantEngine, eventually, group_ids, items

from areal_like.rollout import DataCursor, RolloutError

# max_concurrent_rollouts=1: episodes finish in submission order, so the sequence of data ids
# an uninterrupted run consumes is deterministic and can be compared with a resumed run.
CONFIG = dict(max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=1)


def loader() -> list[list[dict]]:
    return [items(2 * b, 2 * b + 2) for b in range(7)]  # 14 items: the run wraps an epoch


def started_engine(version: int = 0) -> InstantEngine:
    engine = InstantEngine(rollout_config(**CONFIG))
    engine.initialize()
    engine.set_version(version)
    return engine


def run_steps(engine: InstantEngine, data, first_step: int, steps: int,
              base: int = 0) -> list[list[int]]:
    out = []
    for step in range(first_step, first_step + steps):
        out.append(group_ids(engine.executor.prepare_batch(data, GroupWorkflow())))
        engine.set_version(base + step + 1)
    return out


# base: the version the run starts at (a fleet already at version 3): the same run, shifted
@pytest.mark.parametrize("base", [0, 3])
def test_state_dict_round_trip_resumes_exactly(base: int):
    reference = started_engine(base)
    try:
        expected = run_steps(reference, loader(), 0, 9, base)
    finally:
        reference.destroy()
    assert [i for batch in expected for i in batch][:14] == list(range(14))

    first = started_engine(base)
    try:
        data = loader()
        got = run_steps(first, data, 0, 4, base)
        ex = first.executor
        got.append(group_ids(ex.prepare_batch(data, GroupWorkflow())))  # step 4, no bump
        # at step 4 the bound (1 + 4 + 1) x 2 = 12 admits groups 0..11 and 10 are consumed;
        # prefetch drew 2 more (12, 13) that wait for the next version
        eventually(lambda: ex.stats()["buffered"] == 2 and ex.stats()["running"] == 0,
                   what="admitted groups finished")
        state = ex.state_dict()
    finally:
        first.destroy()
    buffered_ids = [int(dict(b["trajectory"]["leaves"])[("data_id",)][0])
                    for b in state["buffered"]]
    assert buffered_ids == [10, 11]
    assert [d["id"] for d in state["pending_data"]] == [12, 13]
    assert state["data_position"] == {"epoch": 0, "batches_drawn": 7, "items_drawn": 14}
    assert state["start_version"] == base
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    restored_state = torch.load(blob, weights_only=True)
    if base == 0:  # a state saved before the start version was recorded: its run began at 0
        del restored_state["start_version"]

    second = InstantEngine(rollout_config(**CONFIG))
    second.initialize()
    try:
        second.executor.load_state_dict(restored_state)
        assert second.get_version() == base + 4
        assert second.executor.stats()["buffered"] == 2
        second.set_version(base + 5)
        data = loader()  # a new, equal dataloader: the executor resumes its position
        first_batch = second.executor.prepare_batch(data, GroupWorkflow())
        assert group_ids(first_batch) == buffered_ids
        # the buffered groups come back bit for bit (versions included)
        saved = state["buffered"][0]["trajectory"]["leaves"]
        for key, value in saved:
            region = tuple(slice(0, n) for n in value.shape)
            assert torch.equal(first_batch[key][region], value), key
        second.set_version(base + 6)
        got += [group_ids(first_batch)] + run_steps(second, data, 6, 3, base)
        s = second.executor.stats()
        assert s["consumed"] == 18 and s["dropped_stale"] == 0
        assert second.executor.state_dict()["data_position"]["epoch"] == 1
    finally:
        second.destroy()
    assert got == expected


def test_a_state_restored_twice_counts_every_submission_once():
    """Saved again before its unfinished items were re-queued, a restored state still counts
    them as submitted (once)."""
    engine = started_engine()
    try:
        data = loader()
        run_steps(engine, data, 0, 4)
        engine.executor.prepare_batch(data, GroupWorkflow())  # step 4: 12, 13 drawn, not run
        ex = engine.executor
        eventually(lambda: ex.stats()["buffered"] == 2 and ex.stats()["running"] == 0,
                   what="admitted groups finished")  # 10, 11: one at a time
        state = ex.state_dict()
    finally:
        engine.destroy()
    assert len(state["pending_data"]) == 2 and state["counters"]["submitted"] == 14
    for _ in range(2):  # restore, save at once, restore that
        again = InstantEngine(rollout_config(**CONFIG))
        again.executor.load_state_dict(state)
        state = again.executor.state_dict()
        assert state["counters"]["submitted"] == 14
        assert [d["id"] for d in state["pending_data"]] == [12, 13]
    again.initialize()
    try:
        assert again.executor.resubmit_restored(GroupWorkflow()) == 2
        assert again.executor.stats()["submitted"] == 14
    finally:
        again.destroy()


def test_state_dict_never_sees_data_drawn_but_not_yet_queued():
    """prepare_batch in one thread, state_dict in another: the saved position never counts
    items that the saved queue does not hold (they would be skipped after a resume)."""
    engine = started_engine()
    ex, drawn, go, saved = engine.executor, threading.Event(), threading.Event(), []
    enqueue = ex._state.enqueue

    def held_enqueue(*args, **kwargs):  # the cursor has moved; the items are not queued yet
        drawn.set()
        go.wait(30)
        return enqueue(*args, **kwargs)

    ex._state.enqueue = held_enqueue
    batch = threading.Thread(target=ex.prepare_batch, args=(loader(), GroupWorkflow()))
    saver = threading.Thread(target=lambda: saved.append(ex.state_dict()))
    try:
        batch.start()
        assert drawn.wait(30)
        saver.start()
        saver.join(0.5)  # room to save inside the window, if it could
        go.set()
        saver.join(30)
        batch.join(30)
        assert not saver.is_alive() and not batch.is_alive()
    finally:
        go.set()
        engine.destroy()
    state = saved[0]
    assert state["data_position"]["items_drawn"] == state["counters"]["submitted"] > 0, state


def test_load_state_dict_needs_a_fresh_executor():
    engine = started_engine()
    try:
        data = loader()
        engine.executor.prepare_batch(data, GroupWorkflow())
        state = engine.executor.state_dict()
        with pytest.raises(RolloutError, match="fresh executor"):
            engine.executor.load_state_dict(state)
        with pytest.raises(KeyError, match="missing"):
            InstantEngine(rollout_config(**CONFIG)).executor.load_state_dict({"format": 1})
    finally:
        engine.destroy()


def test_prepare_batch_rejects_a_second_dataloader():
    engine = started_engine()
    try:
        data = loader()
        engine.executor.prepare_batch(data, GroupWorkflow())
        engine.executor.prepare_batch(data, GroupWorkflow())  # the same one is fine
        with pytest.raises(ValueError, match="different dataloader"):
            engine.executor.prepare_batch(loader(), GroupWorkflow())
    finally:
        engine.destroy()


class EpochShuffledLoader:
    """Order is a function of (seed, epoch), set through `set_epoch`."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed, self.epoch = n, batch, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        for i in range(0, self.n, self.batch):
            yield [{"id": j} for j in order[i: i + self.batch]]


def draw(cursor: DataCursor, k: int) -> list[list[int]]:
    return [[d["id"] for d in cursor.next_items()] for _ in range(k)]


def test_cursor_resumes_with_set_epoch():
    full = draw(DataCursor(EpochShuffledLoader(7, 3, seed=4)), 10)  # 3 batches per epoch
    cursor = DataCursor(EpochShuffledLoader(7, 3, seed=4))
    head = draw(cursor, 5)
    assert cursor.position() == {"epoch": 1, "batches_drawn": 2, "items_drawn": 6}
    resumed = DataCursor(EpochShuffledLoader(7, 3, seed=4), **cursor.position())
    assert head + draw(resumed, 5) == full
    assert full[0:3] != full[3:6]  # epochs really are shuffled differently


def test_cursor_replays_a_seeded_torch_dataloader():
    def make():
        data = [{"id": i} for i in range(10)]
        return torch.utils.data.DataLoader(
            data, batch_size=4, shuffle=True, collate_fn=lambda b: b,
            generator=torch.Generator().manual_seed(3))

    full = draw(DataCursor(make()), 8)  # 3 batches per epoch
    cursor = DataCursor(make())
    head = draw(cursor, 4)
    resumed = DataCursor(make(), **cursor.position())
    assert head + draw(resumed, 4) == full


def test_cursor_errors():
    with pytest.raises(ValueError, match="only 3 batches"):
        DataCursor(EpochShuffledLoader(7, 3, seed=0), epoch=0, batches_drawn=4).next_items()
    with pytest.raises(ValueError, match="yielded nothing"):
        DataCursor([]).next_items()
    with pytest.raises(TypeError, match="collate_fn"):
        DataCursor([[1, 2]]).next_items()
