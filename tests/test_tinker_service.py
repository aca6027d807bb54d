"""TinkerService's ordering of a model's calls, in one process: the trainer ranks are a
recorder here (the real ranks run in tests/test_tinker_api.py), so the arithmetic of seq_ids
is checked alone — out-of-order arrival, a repeated seq_id, a call refused by its checks, a
seq_id that never comes."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from areal_like.tinker.callers import CALLER, key_fingerprint
from areal_like.tinker.errors import Conflict, NotFound
from areal_like.tinker.futures import FutureStore
from areal_like.tinker.service import ServiceConfig, TinkerService


class RecordingRanks:
    """Stands in for TrainerRanks: records the calls in the order they are queued."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def submit(self, method: str, *args: Any) -> asyncio.Future[Any]:
        self.calls.append((method, args))
        if method in ("save_state", "save_adapter"):  # (model id, folder): the folder exists
            os.makedirs(args[1])
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
    assert "without '/'" in results[0] and "expected a finite number" in results[1]
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


async def test_another_request_under_a_used_seq_id_is_refused_not_answered(tmp_path) -> None:
    """Only the same request again (an SDK retry) gets the first one's future: a different
    one under that seq_id (another client using this model's id) is a conflict."""
    service, ranks = _service(tmp_path)
    model = await _model(service)
    first = service.optim_step(_optim(model, 1, lr=1.0))
    assert service.optim_step(_optim(model, 1, lr=1.0)) == first
    with pytest.raises(Conflict, match="seq_id 1 was used by another request"):
        service.optim_step(_optim(model, 1, lr=5.0))
    await _results(service.futures, [first])


async def test_a_forward_backward_whose_data_is_refused_uses_its_seq_id(tmp_path) -> None:
    """A datum the wire could not decode (e.g. no tokens) fails its own future in its turn:
    the model's next call runs at once instead of waiting for the seq_id gap."""
    from areal_like.tinker.wire import ForwardBackwardCall

    service, ranks = _service(tmp_path)
    model = await _model(service)
    refused = ForwardBackwardCall(model, 1, "cross_entropy", {}, False, [],
                                  refused="datum 0: model_input has no tokens")
    ids = [service.forward_backward(refused, "digest-1"), service.optim_step(_optim(model, 2))]
    results = await _results(service.futures, ids)
    assert "datum 0: model_input has no tokens" in results[0]
    assert results[1]["type"] == "optim_step" and service.futures.pending() == 0


async def test_sessions_models_and_samplers_belong_to_the_key_that_made_them(tmp_path) -> None:
    service, _ = _service(tmp_path)
    owner, stranger = key_fingerprint("tml-owner"), key_fingerprint("tml-stranger")
    CALLER.set(owner)
    model = await _model(service)
    session = model.rsplit(":train:", 1)[0]
    sampler = service.create_sampling_session({"session_id": session})
    CALLER.set(stranger)
    for call in (lambda: service.session(session), lambda: service.model(model),
                 lambda: service.optim_step(_optim(model, 1)),
                 lambda: service.sampler_info(sampler),
                 lambda: service.create_sampling_session({"session_id": session})):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(NotFound):  # nor end it
        await service.finish_callers_session(session)
    CALLER.set(owner)
    assert service.sampler_info(sampler)["sampler_id"] == sampler
    done = await _results(service.futures, [service.optim_step(_optim(model, 1))])
    assert done[0]["type"] == "optim_step"


async def test_a_training_run_and_its_checkpoints_are_listed_and_loaded_by_its_key_only(
        tmp_path) -> None:
    service, _ = _service(tmp_path)
    owner, stranger = key_fingerprint("tml-owner"), key_fingerprint("tml-stranger")
    CALLER.set(owner)
    model = await _model(service)
    saved = await _results(service.futures, [
        service.save_weights({"model_id": model, "seq_id": 1, "path": "first"})])
    path = saved[0]["path"]
    assert path == f"tinker://{model}/weights/first"
    assert [r["training_run_id"] for r in service.training_runs(20, 0)["training_runs"]] == \
        [model]
    for live in (True, False):  # the model alive, then only its checkpoint on disk
        CALLER.set(stranger)
        assert service.training_runs(20, 0) == {
            "training_runs": [], "cursor": {"offset": 0, "limit": 20, "total_count": 0}}
        for call in (lambda: service.training_run(model),
                     lambda: service.weights_info(path),
                     lambda: service.load_weights({"session_id": service.create_session(),
                                                   "path": path})):
            with pytest.raises(NotFound):
                call()
        with pytest.raises(NotFound):
            await service.delete_checkpoint(model, "weights/first")
        CALLER.set(owner)
        assert service.training_run(model)["last_checkpoint"]["tinker_path"] == path
        assert service.weights_info(path)["lora_rank"] == 4
        if live:
            service.models.pop(model)


def test_tinker_serve_refuses_bad_flags_before_anything_starts(tmp_path, capsys,
                                                               monkeypatch) -> None:
    import socket
    import subprocess

    from areal_like.tinker.serve import main

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    base = ["--model-path", str(tmp_path)]
    for flags, message in ((["--max-models", "0"], "--max-models 0: must be >= 1"),
                           (["--port", "70000"], "--port 70000: a TCP port is 1..65535")):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*base, "--port", str(port)]) == 2
    assert f"--port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
