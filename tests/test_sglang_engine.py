"""The fleet client against real servers, SGLang and vLLM (`any_fleet`): log-probs,
determinism, stops, routing, auth, timeouts. Each fleet (two servers, tiny 1m model) is
shared by the session (conftest)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import (
    LOGPROB_ATOL,
    eos_token_id,
    fleet_engine,
    hf_logprobs,
    hf_next_token_logprobs,
    make_engine,
)
from transformers import AutoConfig

from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest
from areal_like.api.rollout_config import FleetClientConfig
from engines.server.errors import InferenceServerError

PROMPTS = [[1, 2, 3, 4], [17, 29, 5, 60, 61, 2], [300, 12], [7] * 9]


@pytest.fixture(scope="module")
def engine(any_fleet):
    engine = fleet_engine(any_fleet)
    yield engine
    engine.destroy()


def _versions_match_server(resp) -> None:
    assert len(set(resp.output_versions)) == 1 and resp.output_versions[0] >= 0


async def test_sampled_logprobs_match_hf_forward(engine, tiny_model_dir):
    g = GenerationHyperparameters(max_new_tokens=24, temperature=1.0)
    resps = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=p, gconfig=g))
                                   for p in PROMPTS))
    for prompt, resp in zip(PROMPTS, resps, strict=True):
        assert resp.input_tokens == prompt
        assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions)
        assert resp.stop_reason in ("stop", "length")
        ref = hf_logprobs(tiny_model_dir, prompt, resp.output_tokens)
        got = torch.tensor(resp.output_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, ref, atol=LOGPROB_ATOL, rtol=0)
        _versions_match_server(resp)


async def test_given_tokens_are_scored_as_the_hf_forward_and_the_sampler_do(engine,
                                                                         tiny_model_dir):
    """`ascore`: log-probs of tokens the server did not sample (a prefill), equal to an HF
    float64 forward and to what generation reported for the same tokens."""
    g = GenerationHyperparameters(max_new_tokens=16, temperature=1.0)
    resps = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=p, gconfig=g))
                                   for p in PROMPTS))
    for prompt, resp in zip(PROMPTS, resps, strict=True):
        ids = prompt + resp.output_tokens
        got = torch.tensor(await engine.ascore(ids, len(prompt)), dtype=torch.float64)
        assert got.shape == (len(resp.output_tokens),)
        ref = hf_logprobs(tiny_model_dir, prompt, resp.output_tokens)
        torch.testing.assert_close(got, ref, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(got, torch.tensor(resp.output_logprobs, dtype=torch.float64),
                                   atol=LOGPROB_ATOL, rtol=0)
    # with the top-k tokens of every position (a distillation teacher's distribution)
    k = 5
    scored = await engine.ascore_top_batch([p + r.output_tokens for p, r in zip(PROMPTS, resps,
                                                                               strict=True)],
                                           [len(p) for p in PROMPTS], top_k=k)
    for prompt, resp, one in zip(PROMPTS, resps, scored, strict=True):
        full = hf_next_token_logprobs(tiny_model_dir, prompt, resp.output_tokens)
        ids = torch.tensor(one.top_ids)
        assert ids.shape == (len(resp.output_tokens), k)
        top = torch.tensor(one.top_logprobs, dtype=torch.float64)
        torch.testing.assert_close(top, full.gather(-1, ids), atol=LOGPROB_ATOL, rtol=0)
        assert (top[:, :-1] >= top[:, 1:]).all()  # most likely first
        # no token left out is more likely than the k-th kept (up to the tolerance)
        kth = full.topk(k, dim=-1).values[:, -1]
        assert (top[:, -1] >= kth - LOGPROB_ATOL).all()
        torch.testing.assert_close(torch.tensor(one.logprobs, dtype=torch.float64),
                                   hf_logprobs(tiny_model_dir, prompt, resp.output_tokens),
                                   atol=LOGPROB_ATOL, rtol=0)
    # tokens nobody sampled: a prompt scored from its second token
    prompt = PROMPTS[1]
    got = torch.tensor(await engine.ascore(prompt, 1), dtype=torch.float64)
    torch.testing.assert_close(got, hf_logprobs(tiny_model_dir, prompt[:1], prompt[1:]),
                               atol=LOGPROB_ATOL, rtol=0)
    # the vocabulary's last id, which SGLang reports as token 0 (engines/sglang/protocol.py)
    last = AutoConfig.from_pretrained(tiny_model_dir).vocab_size - 1
    ids = [11, last, 7, last, last]
    got = torch.tensor(await engine.ascore(ids, 1), dtype=torch.float64)
    torch.testing.assert_close(got, hf_logprobs(tiny_model_dir, ids[:1], ids[1:]),
                               atol=LOGPROB_ATOL, rtol=0)
    for start in (0, len(prompt)):
        with pytest.raises(ValueError, match=f"start={start} must be in"):
            await engine.ascore(prompt, start)


async def test_greedy_is_deterministic_and_argmax(engine, tiny_model_dir):
    g = GenerationHyperparameters(max_new_tokens=20, greedy=True)
    # Different rids spread the copies over both servers.
    resps = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=PROMPTS[1], gconfig=g))
                                   for _ in range(4)))
    assert {r.metadata["server"] for r in resps} == set(engine.addresses)
    for r in resps[1:]:
        assert r.output_tokens == resps[0].output_tokens
        torch.testing.assert_close(torch.tensor(r.output_logprobs),
                                   torch.tensor(resps[0].output_logprobs), atol=1e-5, rtol=0)
    # Greedy = argmax of the reference model at every step.
    from sglang_helpers import _reference_model

    ids = torch.tensor([PROMPTS[1] + resps[0].output_tokens])
    with torch.no_grad():
        logits = _reference_model(str(tiny_model_dir))(input_ids=ids).logits[0]
    argmax = logits[len(PROMPTS[1]) - 1 : -1].argmax(-1).tolist()
    assert resps[0].output_tokens == argmax


async def test_stop_token_ids_end_generation_and_are_kept(engine):
    g = GenerationHyperparameters(max_new_tokens=30, greedy=True)
    full = await engine.agenerate(ModelRequest(input_ids=PROMPTS[0], gconfig=g))
    stop_at = next(i for i, t in enumerate(full.output_tokens) if t != full.output_tokens[0])
    stop_token = full.output_tokens[stop_at]
    resp = await engine.agenerate(
        ModelRequest(input_ids=PROMPTS[0], gconfig=g.new(stop_token_ids=[stop_token])))
    assert resp.stop_reason == "stop"
    assert resp.output_tokens == full.output_tokens[: stop_at + 1]
    assert resp.output_logprobs == pytest.approx(full.output_logprobs[: stop_at + 1], abs=1e-5)


async def test_length_stop_and_min_new_tokens(engine, tiny_model_dir):
    g = GenerationHyperparameters(max_new_tokens=12, min_new_tokens=12, temperature=1.0)
    resp = await engine.agenerate(ModelRequest(input_ids=PROMPTS[2], gconfig=g))
    assert resp.stop_reason == "length" and len(resp.output_tokens) == 12
    # Under min_new_tokens SGLang samples with EOS banned and reports the log-probs of that
    # distribution (a trainer recomputing log-probs without the ban differs by ~log(1-p_eos)).
    eos = eos_token_id(tiny_model_dir)
    assert eos not in resp.output_tokens
    ref = hf_logprobs(tiny_model_dir, PROMPTS[2], resp.output_tokens, banned_token_ids=(eos,))
    torch.testing.assert_close(torch.tensor(resp.output_logprobs, dtype=torch.float64), ref,
                               atol=LOGPROB_ATOL, rtol=0)


async def test_many_long_seeded_prompts_at_once_all_complete(engine):
    """More prompt tokens than one engine step computes: prefills are scheduled over several
    steps (vLLM 0.32 on CPU crashed when it split one seeded prefill, see engines/vllm/command.py)."""
    g = GenerationHyperparameters(max_new_tokens=8, min_new_tokens=8, temperature=1.0)
    prompts = [[(i * 7 + j) % 400 + 3 for j in range(600)] for i in range(48)]
    resps = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=p, gconfig=g,
                                                                 seed=i))
                                   for i, p in enumerate(prompts)))
    assert all(len(r.output_tokens) == 8 and r.stop_reason == "length" for r in resps)


async def test_agenerate_n_fans_out_on_one_server(engine, tiny_model_dir):
    g = GenerationHyperparameters(max_new_tokens=10, temperature=1.0, n_samples=4)
    req = ModelRequest(input_ids=PROMPTS[3], gconfig=g)
    with pytest.raises(ValueError, match="agenerate_n"):
        await engine.agenerate(req)
    resps = await engine.agenerate_n(req)
    assert [r.rid for r in resps] == [f"{req.rid}-{i}" for i in range(4)]
    assert len({r.metadata["server"] for r in resps}) == 1  # sticky: shared prefix cache
    for r in resps:
        ref = hf_logprobs(tiny_model_dir, PROMPTS[3], r.output_tokens)
        torch.testing.assert_close(torch.tensor(r.output_logprobs, dtype=torch.float64), ref,
                                   atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.sglang
async def test_requests_merged_in_a_window_sample_what_separate_ones_do(sglang_fleet):
    """`rollout.client.batch_window_ms`: prompts asked for together with the same sampling
    parameters go as one request (groups and single samples alike), and every sample's tokens
    are those of the separate requests (seeded sampling), their log-probs too within float32
    rounding. Sampled and greedy requests are asked for apart: sharing one scheduler batch,
    a greedy row changes what SGLang's sampler draws for the sampled ones, merged or not."""
    sampled = GenerationHyperparameters(max_new_tokens=6, temperature=1.0, n_samples=3)
    greedy = GenerationHyperparameters(max_new_tokens=6, greedy=True)
    groups = [ModelRequest(input_ids=p, gconfig=sampled, seed=10 + i, rid=f"group-{i}")
              for i, p in enumerate(PROMPTS)]
    singles = [ModelRequest(input_ids=p, gconfig=greedy, rid=f"single-{i}")
               for i, p in enumerate(PROMPTS[:2])]
    results = {}
    for window in (0.0, 200.0):
        client = fleet_engine(sglang_fleet, client=FleetClientConfig(batch_window_ms=window))
        try:
            sampled_out = await asyncio.gather(*(client.agenerate_n(r) for r in groups))
            greedy_out = await asyncio.gather(*(client.agenerate(r) for r in singles))
            results[window] = [[(r.output_tokens, r.output_logprobs) for r in g]
                               for g in [*sampled_out, greedy_out]]
            coalescer = client.requests.coalescer
            if window:  # one request for the four groups, one for the two greedy samples
                assert coalescer is not None and coalescer.requests == coalescer.merged == 2
                assert len({r.metadata["server"] for g in sampled_out for r in g}) == 1
            else:
                assert coalescer is None
        finally:
            client.destroy()
    # the same tokens; log-probs within float32 rounding: which requests share a scheduler
    # batch is timing's choice when they are sent apart, and on some CPUs a batch's row count
    # changes a reduction in its last bit (this fleet runs without batch-invariant kernels)
    for merged, apart in zip(results[200.0], results[0.0], strict=True):
        for (merged_ids, merged_lp), (apart_ids, apart_lp) in zip(merged, apart, strict=True):
            assert merged_ids == apart_ids
            assert merged_lp == pytest.approx(apart_lp, abs=1e-5, rel=0)
    assert len({tuple(t) for g in results[0.0][:-1] for t, _ in g}) > 1  # really sampled


async def test_same_rid_sticks_to_its_server(engine):
    g = GenerationHyperparameters(max_new_tokens=4, greedy=True)
    servers = set()
    for turn in range(3):  # a multi-turn conversation keeps its rid
        resp = await engine.agenerate(ModelRequest(input_ids=PROMPTS[0] + [turn], gconfig=g,
                                                   rid="conversation-1"))
        servers.add(resp.metadata["server"])
    assert len(servers) == 1


async def test_server_requires_the_api_key(any_fleet):
    backend = any_fleet.config.backend
    engine = make_engine(any_fleet.addresses[:1], api_key="wrong-key", backend=backend)
    payload = engine.api.generate_payload([1, 2], GenerationHyperparameters(), "r", 2, 0)
    async with aiohttp.ClientSession() as session:
        url = f"http://{any_fleet.addresses[0]}{engine.api.generate_path}"
        async with session.post(url, json=payload) as resp:
            assert resp.status == 401
    try:
        with pytest.raises(InferenceServerError, match=r"HTTP 401"):
            await engine.agenerate(ModelRequest(input_ids=[1, 2]))
    finally:
        engine.destroy()


async def test_request_timeout_fails_with_a_clear_error(any_fleet):
    engine = make_engine(any_fleet.addresses[:1], SGLANG_TEST_API_KEY, request_timeout=0.2,
                         request_retries=1, backend=any_fleet.config.backend)
    g = GenerationHyperparameters(max_new_tokens=1000, min_new_tokens=1000)
    try:
        with pytest.raises(InferenceServerError) as info:
            await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g))
        msg = str(info.value)
        assert any_fleet.addresses[0] in msg and "timed out after 0.2 s" in msg
    finally:
        engine.destroy()
