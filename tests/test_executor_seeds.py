"""Episode seeds in the executor (unit tests against an in-process engine whose "samples" are a
function of the request's seed, as on a server running deterministic inference)."""

from __future__ import annotations

import asyncio
import io
from typing import Optional

import torch
from config_helpers import rollout_config
from test_executor_fakes import GroupWorkflow, InstantEngine, eventually, group_ids, items

from areal_like.api import ModelRequest, ModelResponse
from areal_like.api.seeding import data_key, derive_seed, request_seed


class SeededEngine(InstantEngine):
    """Output token t of a request is a function of its seed and t."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        seed = request_seed(req)
        n = req.gconfig.max_new_tokens
        out = [(seed >> (5 * t)) % 50 + 1 for t in range(n)]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                             output_logprobs=[-0.5] * n, output_versions=[self.version] * n)


class HeldFrom(GroupWorkflow):
    """Episodes of items with id >= `first_held` never finish (until shutdown cancels them)."""

    def __init__(self, first_held: int) -> None:
        super().__init__()
        self.first_held = first_held

    async def arun_episode(self, engine, data):
        if data["id"] >= self.first_held:
            await asyncio.Event().wait()
        return await super().arun_episode(engine, data)


def started(**config) -> SeededEngine:
    engine = SeededEngine(rollout_config(**config))
    engine.initialize()
    return engine


def expected_rows(item: dict, repeat: int, run_seed: int, n: int = 2) -> list[list[int]]:
    """What GroupWorkflow's n requests for `item` generate on its `repeat`-th rollout."""
    episode = derive_seed(run_seed, data_key(item), repeat)
    rows = []
    for i in range(n):
        seed = derive_seed(episode, i)
        rows.append(item["prompt"] + [(seed >> (5 * t)) % 50 + 1
                                      for t in range(2 + i + item["id"] % 3)])
    return rows


def rows_of(batch) -> list[list[int]]:
    return [ids[mask].tolist() for ids, mask in zip(batch["input_ids"],
                                                     batch["attention_mask"], strict=True)]


def test_requests_get_the_seeds_of_their_item_and_repetition():
    engine = started(seed=5, consumer_batch_size=3)
    try:
        data = items(0, 3)
        first = engine.executor.rollout_batch(data, GroupWorkflow())
        again = engine.executor.rollout_batch(data, GroupWorkflow())
    finally:
        engine.destroy()
    assert rows_of(first) == [r for it in data for r in expected_rows(it, 0, 5)]
    assert rows_of(again) == [r for it in data for r in expected_rows(it, 1, 5)]
    assert rows_of(first) != rows_of(again)


def test_eta_zero_stream_draws_what_rollout_batch_draws_in_submission_order():
    """prepare_batch (eta = 0, episodes finishing in shuffled order, 8 at a time) against
    rollout_batch of the same items: the same rows, in the same order."""
    batches = [items(4 * b, 4 * b + 4) for b in range(3)]
    config = dict(seed=9, max_head_offpolicyness=0, consumer_batch_size=4,
                  max_concurrent_rollouts=8)
    streamed, synchronous = started(**config), started(**config)
    try:
        for step in range(3):
            a = streamed.executor.prepare_batch(batches, GroupWorkflow(max_sleep=0.02, seed=step))
            b = synchronous.executor.rollout_batch(batches[step], GroupWorkflow())
            assert group_ids(a) == [it["id"] for it in batches[step]]
            assert rows_of(a) == rows_of(b)
            for engine in (streamed, synchronous):
                engine.set_version(step + 1)
    finally:
        streamed.destroy()
        synchronous.destroy()


def test_items_in_flight_at_a_checkpoint_draw_their_samples_again_after_restore():
    config = dict(seed=3, max_head_offpolicyness=1, consumer_batch_size=2,
                  max_concurrent_rollouts=1)
    data = [items(2 * b, 2 * b + 2) for b in range(4)]  # 8 items: the run wraps an epoch

    def steps(engine: SeededEngine, first: int, count: int,
              workflow: Optional[GroupWorkflow] = None) -> list[list[list[int]]]:
        out = []
        for step in range(first, first + count):
            out.append(rows_of(engine.executor.prepare_batch(data, workflow or GroupWorkflow())))
            engine.set_version(step + 1)
        return out

    reference = started(**config)
    try:
        expected = steps(reference, 0, 7)
    finally:
        reference.destroy()
    # the second epoch's rollouts of item 0 are its repetition 1
    assert expected[4][:2] == expected_rows(items(0, 1)[0], 1, 3)

    first = started(**config)
    try:
        # items 4.. (prefetched beyond the 2 consumed batches) are held in flight: the
        # checkpoint is taken while they are unfinished, whatever the machine's speed
        got = steps(first, 0, 2, HeldFrom(4))
        eventually(lambda: first.executor.stats()["submitted"] == 8, what="prefetch")
        state = first.executor.state_dict()
    finally:
        first.destroy()
    assert [d["id"] for d in state["pending_data"]] == [4, 5, 6, 7]
    assert len(state["pending_seeds"]) == len(state["pending_data"])
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    second = SeededEngine(rollout_config(**{**config, "seed": 1234}))  # the state's seed wins
    second.initialize()
    try:
        second.executor.load_state_dict(torch.load(blob, weights_only=True))
        got += steps(second, 2, 5)
    finally:
        second.destroy()
    assert got == expected
