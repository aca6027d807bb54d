"""`RequestCoalescer` on its own (engines/fleet/coalescing.py): what merges, what each waiter
gets back, a full batch, a failed merged request, a cancelled waiter. The post function is a
recording stand-in; against a real SGLang server the merged requests' samples equal the
separate requests' (tests/test_sglang_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from engines.fleet.coalescing import RequestCoalescer
from engines.server.replies import GenerateReply, GroupReply
from engines.sglang.protocol import group_payload


def _payload(rid: str, stream: bool = False) -> dict:
    return {"input_ids": [1, 2], "sampling_params": {"seed": len(rid), "max_new_tokens": 4},
            "return_logprob": True,
            "rid": rid, "stream": stream}


def _reply(rid: str) -> GenerateReply:
    return GenerateReply(output_ids=[len(rid)], logprobs=[-0.5], versions=[0],
                         stop_reason="stop", meta_info={"id": rid})


class Recorder:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.posts: list[tuple[dict, str, list[str]]] = []
        self.fail = fail
        self.release = asyncio.Event()
        self.release.set()

    async def post(self, payload: dict, route_key: str, rids: list[str]):
        self.posts.append((payload, route_key, rids))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return "127.0.0.1:1", GroupReply([_reply(r) for r in rids])


def test_requests_within_the_window_go_as_one_and_each_gets_its_own_replies():
    async def run() -> None:
        rec = Recorder()
        co = RequestCoalescer(group_payload, rec.post, window_s=0.05)
        a = co.submit([_payload("a-0"), _payload("a-1")], "a", ["a-0", "a-1"])
        b = co.submit([_payload("bb-0")], "b", ["bb-0"])
        other = co.submit([_payload("s-0", stream=True)], "s", ["s-0"])  # another kind
        greedy = _payload("g-0")
        greedy["sampling_params"] = {"seed": 1, "temperature": 0.0}  # another sampler
        (addr, ra), (_, rb), (_, rs), _ = await asyncio.gather(
            a, b, other, co.submit([greedy], "g", ["g-0"]))
        assert addr == "127.0.0.1:1"
        assert [r.meta_info["id"] for r in ra] == ["a-0", "a-1"]
        assert [r.meta_info["id"] for r in rb] == ["bb-0"] and rs[0].meta_info["id"] == "s-0"
        merged = [p for p in rec.posts if p[2] == ["a-0", "a-1", "bb-0"]]
        assert len(rec.posts) == 3 and len(merged) == 1
        payload, route_key, _ = merged[0]
        assert route_key == "a" and payload["rid"] == ["a-0", "a-1", "bb-0"]
        assert payload["return_logprob"] is True and len(payload["input_ids"]) == 3
        assert co.requests == 3 and co.merged == 1

    asyncio.run(run())


def test_a_full_batch_goes_at_once():
    async def run() -> None:
        rec = Recorder()
        co = RequestCoalescer(group_payload, rec.post, window_s=60.0, max_samples=2)
        (_, replies), = await asyncio.wait_for(asyncio.gather(
            co.submit([_payload("x-0"), _payload("x-1")], "x", ["x-0", "x-1"])), timeout=10)
        assert len(replies) == 2 and len(rec.posts) == 1

    asyncio.run(run())


def test_a_failed_merged_request_fails_every_waiter_with_its_error():
    async def run() -> None:
        rec = Recorder(fail=RuntimeError("every server refused"))
        co = RequestCoalescer(group_payload, rec.post, window_s=0.01)
        results = await asyncio.gather(co.submit([_payload("a")], "a", ["a"]),
                                       co.submit([_payload("b")], "b", ["b"]),
                                       return_exceptions=True)
        assert [str(r) for r in results] == ["every server refused"] * 2
        assert len(rec.posts) == 1

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_others_their_replies():
    async def run() -> None:
        rec = Recorder()
        rec.release.clear()
        co = RequestCoalescer(group_payload, rec.post, window_s=0.01)
        gone = asyncio.ensure_future(co.submit([_payload("a")], "a", ["a"]))
        kept = asyncio.ensure_future(co.submit([_payload("bb")], "b", ["bb"]))
        while not rec.posts:
            await asyncio.sleep(0.005)
        gone.cancel()
        rec.release.set()
        _, replies = await asyncio.wait_for(kept, timeout=10)
        assert replies[0].meta_info["id"] == "bb" and gone.cancelled()

    asyncio.run(run())


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s=0"):
        RequestCoalescer(group_payload, Recorder().post, window_s=0)
