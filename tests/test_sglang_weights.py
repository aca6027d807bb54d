"""Weight updates on real servers, SGLang and vLLM (`any_fleet`): new weights give new log-probs
and versions; a request in flight across an update reports two version spans that tile its
tokens; an "abort"-mode pause is continued transparently. Every test restores the session
fleet's original weights."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import (
    LOGPROB_ATOL,
    WINDOW_ATTEMPTS,
    eos_token_id,
    fleet_engine,
    fleet_version,
    hf_logprobs,
    make_engine,
    perturbed_copy,
    restore_session_fleet,
)

from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from engines.fleet.client import RemoteInferenceEngine

PROMPT = [11, 22, 33, 44, 55]
SENT_WITHIN_S = 120.0  # a request in flight on a server, however busy the machine


@pytest.fixture(scope="module")
def new_weights_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("tiny_1m_perturbed"), seed=7)


@pytest.fixture
def engine(any_fleet, tiny_model_dir: Path) -> Iterator[RemoteInferenceEngine]:
    engine = fleet_engine(any_fleet)
    # earlier tests may have bumped it
    engine.set_version(fleet_version(any_fleet.addresses, SGLANG_TEST_API_KEY,
                                     any_fleet.config.backend))
    yield engine
    engine.destroy()
    # the session's weights under a fresh version, so other tests see tiny_model_dir
    restore_session_fleet(any_fleet, tiny_model_dir)


def _assert_logprobs(model_dir: Path, prompt: list[int], output: list[int],
                     logprobs: list[float], banned: tuple[int, ...] = ()) -> None:
    ref = hf_logprobs(model_dir, prompt, output, banned)
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), ref,
                               atol=LOGPROB_ATOL, rtol=0)


async def test_update_weights_changes_logprobs_and_version(engine, tiny_model_dir,
                                                          new_weights_dir, any_fleet):
    g = GenerationHyperparameters(max_new_tokens=16, temperature=1.0)
    before = await engine.agenerate_n(ModelRequest(input_ids=PROMPT, gconfig=g.new(n_samples=2)))
    for r in before:
        _assert_logprobs(tiny_model_dir, PROMPT, r.output_tokens, r.output_logprobs)
    old = engine.get_version()
    # The sync wrapper, as trainer code calls it (it blocks this loop; the work runs on the
    # engine's rollout loop).
    engine.update_weights(WeightUpdateMeta.from_disk(str(new_weights_dir), old + 1))
    assert engine.get_version() == old + 1
    assert fleet_version(any_fleet.addresses, SGLANG_TEST_API_KEY,
                         any_fleet.config.backend) == old + 1
    # Concurrent requests spread over both servers, so both are checked.
    after = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
                                   for _ in range(4)))
    assert len({r.metadata["server"] for r in after}) == 2
    for r in after:
        assert r.output_versions == [old + 1] * len(r.output_tokens)
        _assert_logprobs(new_weights_dir, PROMPT, r.output_tokens, r.output_logprobs)
        # ...and they are not the old weights' log-probs.
        stale = hf_logprobs(tiny_model_dir, PROMPT, r.output_tokens)
        assert (torch.tensor(r.output_logprobs, dtype=torch.float64) - stale).abs().max() > 1e-2


async def _until_sent(engine: RemoteInferenceEngine, request: asyncio.Future | Any) -> None:
    """Until `request` is in flight on a server, or ended (its error then shows where it is
    awaited); bounded, so a request that never leaves the client fails the test, not hangs it."""
    deadline = asyncio.get_running_loop().time() + SENT_WITHIN_S
    while sum(engine.inflight().values()) == 0 and not request.done():
        assert asyncio.get_running_loop().time() < deadline, (
            f"the request reached no server within {SENT_WITHIN_S} s")
        await asyncio.sleep(0.01)


async def _generate_across_update(engine: RemoteInferenceEngine, new_dir: Path, version: int,
                                  n_tokens: int, delay: float):
    g = GenerationHyperparameters(max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                  temperature=1.0)
    task = asyncio.ensure_future(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
    await _until_sent(engine, task)
    await asyncio.sleep(delay)  # let it generate some tokens with the old weights
    await engine.aupdate_weights(WeightUpdateMeta.from_disk(str(new_dir), version))
    return await task


async def test_request_in_flight_reports_both_versions(engine, tiny_model_dir, new_weights_dir):
    # The update must land mid-generation. No timing is assumed: an update that came before
    # the first token is tried again later, one after the last token earlier; the attempts
    # alternate the two weight sets, so every update changes the weights.
    old_dir, n_tokens, delay = tiny_model_dir, 1000, 0.3
    for attempt in range(WINDOW_ATTEMPTS):
        new_dir = (new_weights_dir, tiny_model_dir)[attempt % 2]
        old = engine.get_version()
        new = old + 1
        resp = await _generate_across_update(engine, new_dir, new, n_tokens, delay)
        assert len(resp.output_tokens) == n_tokens and resp.stop_reason == "length"
        assert set(resp.output_versions) <= {old, new}
        if len(set(resp.output_versions)) == 2:
            break
        delay = delay * 2.5 if resp.output_versions[0] == new else delay / 4
        old_dir = new_dir
    else:
        pytest.fail("the weight update never landed while a request was generating")
    first = resp.output_versions.index(new)
    assert first > 0 and resp.output_versions == [old] * first + [new] * (n_tokens - first)
    # Tokens of each span were produced by that span's weights (EOS excluded: min_new_tokens).
    banned = (eos_token_id(tiny_model_dir),)
    _assert_logprobs(old_dir, PROMPT, resp.output_tokens[:first], resp.output_logprobs[:first],
                     banned)
    ref_new = hf_logprobs(new_dir, PROMPT, resp.output_tokens, banned)[first:]
    torch.testing.assert_close(torch.tensor(resp.output_logprobs[first:], dtype=torch.float64),
                               ref_new, atol=LOGPROB_ATOL, rtol=0)


async def test_abort_mode_pause_is_continued_transparently(any_fleet, engine):
    abort_engine = make_engine(any_fleet.addresses[:1], SGLANG_TEST_API_KEY,
                               pause_mode="abort", backend=any_fleet.config.backend)
    try:
        # a prompt's two samples (SGLang: one request, each sample continued alone)
        g = GenerationHyperparameters(max_new_tokens=800, min_new_tokens=800, temperature=1.0,
                                      n_samples=2)
        # a pause that comes before the scheduler holds the request does not abort it (it
        # waits in the HTTP front end): then pause later; one after the request ended: earlier
        delay = 0.2
        for _ in range(WINDOW_ATTEMPTS):
            task = asyncio.ensure_future(abort_engine.agenerate_n(ModelRequest(input_ids=PROMPT,
                                                                               gconfig=g)))
            await _until_sent(abort_engine, task)
            await asyncio.sleep(delay)
            ended_first = task.done()
            await abort_engine.apause()
            await asyncio.sleep(0.2)
            await abort_engine.aresume()
            resps = await task
            assert len(resps) == 2 and len({r.rid for r in resps}) == 2
            for resp in resps:
                assert resp.stop_reason == "length" and len(resp.output_tokens) == 800
                assert len(resp.output_versions) == 800
            if all(r.metadata["segments"] >= 2 for r in resps):  # aborted and continued
                break
            delay = delay / 4 if ended_first else delay * 2.5
        else:
            pytest.fail("the pause never caught the request in the scheduler")
    finally:
        abort_engine.destroy()


async def test_a_request_sent_while_an_abort_pause_is_on_its_way_is_continued(any_fleet):
    """A request sent after this engine began an "abort"-mode pause but before the pause
    reached the server is aborted by that pause: it is ours, so it is continued too, never
    returned cut short as if it had ended."""
    abort_engine = make_engine(any_fleet.addresses[:1], SGLANG_TEST_API_KEY,
                               pause_mode="abort", backend=any_fleet.config.backend)
    g = GenerationHyperparameters(max_new_tokens=800, min_new_tokens=800, temperature=1.0)
    on_all, sent, ended_first, delay = abort_engine.membership.on_all, [], [], 0.2

    async def pause_after_a_request(what, call):  # runs inside the pause
        if what.startswith("pause"):
            loop = asyncio.get_running_loop()
            sent.append(asyncio.run_coroutine_threadsafe(
                abort_engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)), loop))
            await _until_sent(abort_engine, sent[-1])
            await asyncio.sleep(delay)  # let the scheduler hold it (see the test above)
            ended_first.append(sent[-1].done())
        return await on_all(what, call)

    abort_engine.membership.on_all = pause_after_a_request
    shortest_ended = None  # a pause sent this late found the request finished: search below
    try:
        for _ in range(WINDOW_ATTEMPTS):  # a busy machine moves the window: bisect
            await abort_engine.apause()
            abort_engine.membership.on_all = on_all
            await abort_engine.aresume()
            resp = await asyncio.wrap_future(sent[-1])
            assert resp.stop_reason == "length" and len(resp.output_tokens) == 800
            assert len(resp.output_versions) == 800
            if resp.metadata["segments"] >= 2:  # the pause caught it and it was continued
                break
            if ended_first[-1]:  # too late: the request had finished
                shortest_ended, delay = delay, delay / 4
            elif shortest_ended is None:  # too early, and nothing too late seen yet
                delay *= 2.5
            else:  # too early: between this and the shortest that was too late
                delay = (delay + shortest_ended) / 2
            abort_engine.membership.on_all = pause_after_a_request
        else:
            pytest.fail("the pause never caught the request in the scheduler")
    finally:
        abort_engine.membership.on_all = on_all
        abort_engine.destroy()


async def test_failed_update_names_the_server_and_keeps_serving(engine, any_fleet,
                                                                tiny_model_dir, tmp_path):
    from engines.server.errors import InferenceServerError

    version = engine.get_version()
    with pytest.raises(InferenceServerError, match="failed to load weights|update_weights") as info:
        await engine.aupdate_weights(WeightUpdateMeta.from_disk(str(tmp_path / "missing"),
                                                                version + 1))
    assert any(addr in str(info.value) for addr in any_fleet.addresses)
    assert engine.get_version() == version  # not bumped
    # The fleet was continued and still serves the old weights.
    g = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
    resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
    _assert_logprobs(tiny_model_dir, PROMPT, resp.output_tokens, resp.output_logprobs)
