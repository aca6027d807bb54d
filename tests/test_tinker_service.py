"""TinkerService's ordering of a model's calls, in one process: the trainer ranks are a
recorder here (the real ranks run in tests/test_tinker_api.py), so the arithmetic of seq_ids
is checked alone — out-of-order arrival, a repeated seq_id, a call refused by its checks, a
seq_id that never comes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_like.tinker.futures import FutureStore
from areal_like.tinker.service import ServiceConfig, TinkerService


class RecordingRanks:
    """Stands in for TrainerRanks: records the calls in the order they are queued."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def submit(self, method: str, *args: Any) -> asyncio.Future[Any]:
        self.calls.append((method, args))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result({"grad_norm:mean": 1.0} if method == "optim_step" else 0)
        return future


def _service(tmp_path: Any) -> tuple[TinkerService, RecordingRanks]:
    ranks = RecordingRanks()
    config = ServiceConfig(model_name="m", model_path=str(tmp_path), storage_dir=str(tmp_path),
                           max_lora_rank=8, seq_gap_timeout_s=0.0, vocab_size=16)
    return TinkerService(config, ranks, sampler=None), ranks  # type: ignore[arg-type]


async def _model(service: TinkerService) -> str:
    session = service.create_session()
    request_id = service.create_model({"session_id": session, "lora_config": {"rank": 4}})
    done = await service.futures.retrieve(request_id, 10)
    assert done is not None and done.error is None, done
    return f"{session}:train:0"


def _optim(model_id: str, seq_id: int, lr: Any = 1e-3) -> dict[str, Any]:
    return {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": lr}}


async def _results(futures: FutureStore, ids: list[str]) -> list[Any]:
    done = [await futures.retrieve(i, 10) for i in ids]
    return [d.error["error"] if d and d.error else d.result if d else None for d in done]


async def test_calls_start_in_seq_id_order_and_a_retry_gets_the_same_future(tmp_path) -> None:
    service, ranks = _service(tmp_path)
    model = await _model(service)
    third = service.optim_step(_optim(model, 3, lr=3.0))
    second = service.optim_step(_optim(model, 2, lr=2.0))
    assert [c for c, _ in ranks.calls] == ["create"]  # seq 1 has not come: both wait
    first = service.optim_step(_optim(model, 1, lr=1.0))
    assert service.optim_step(_optim(model, 2, lr=2.0)) == second  # an SDK retry
    await _results(service.futures, [first, second, third])
    assert [args[1]["learning_rate"] for c, args in ranks.calls if c == "optim_step"] == [
        1.0, 2.0, 3.0]


async def test_a_call_refused_by_its_checks_fails_alone(tmp_path) -> None:
    """Its seq_id is used all the same (the SDK goes on with the next), so the calls after
    it run."""
    service, ranks = _service(tmp_path)
    model = await _model(service)
    ids = [service.save_weights({"model_id": model, "seq_id": 1, "path": "a/b"}),
           service.optim_step(_optim(model, 2, lr="not a number")),
           service.optim_step(_optim(model, 3))]
    results = await _results(service.futures, ids)
    assert "without '/'" in results[0] and "must be a number" in results[1]
    assert results[2] == {"metrics": {"grad_norm:mean": 1.0}, "type": "optim_step"}


async def test_a_seq_id_that_never_comes_is_skipped(tmp_path) -> None:
    service, ranks = _service(tmp_path)
    model = await _model(service)
    later = service.optim_step(_optim(model, 2))
    assert service.futures.pending() == 1
    await service.reap()  # (seq_gap_timeout_s = 0 here)
    assert (await _results(service.futures, [later]))[0]["type"] == "optim_step"
    with pytest.raises(Exception, match="seq_id 1 was used already"):
        service.optim_step(_optim(model, 1))
