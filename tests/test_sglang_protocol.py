"""Unit tests of the SGLang wire format (engines/sglang/protocol.py) and of server selection,
on hand-written replies (no server; the real-server behaviour is in the other test_sglang_*)."""

from __future__ import annotations

import time

import pytest
from config_helpers import rollout_config

from areal_like.api.io_struct import GenerationHyperparameters
from engines.fleet.routing import NoServerInServiceError, ServerPool
from engines.server.errors import ServerProtocolError
from engines.server.replies import versions_from_spans
from engines.sglang.protocol import (
    generate_payload,
    group_payload,
    parse_generate_reply,
    parse_group_reply,
    parse_score_reply,
    score_payload,
)

SERVER = "127.0.0.1:1234"


def _reply(ids, spans, finish="length"):
    return {
        "output_ids": ids,
        "meta_info": {
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)],
            "finish_reason": {"type": finish},
            "weight_versions": spans,
        },
    }


def test_spans_become_one_version_per_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    reply = parse_generate_reply(_reply([7, 8, 9, 10, 11], spans), SERVER)
    assert reply.versions == [3, 3, 4, 4, 4]
    assert reply.logprobs == [-0.5, -1.5, -2.5, -3.5, -4.5]
    assert reply.stop_reason == "length"


def test_default_label_is_version_zero_and_fallback_without_spans():
    assert versions_from_spans({"weight_versions": [{"version": "default", "start": 0,
                                                     "end": 2}]}, 2, SERVER) == [0, 0]
    assert versions_from_spans({"weight_version": "5"}, 3, SERVER) == [5, 5, 5]


@pytest.mark.parametrize("spans, match", [
    ([{"version": "1", "start": 0, "end": 2}], "cover 2 tokens but the reply has 3"),
    ([{"version": "1", "start": 1, "end": 3}], "do not tile"),
    ([{"version": "v1", "start": 0, "end": 3}], "expected an integer label"),
])
def test_bad_spans_name_the_server(spans, match):
    with pytest.raises(ServerProtocolError, match=match) as info:
        parse_generate_reply(_reply([1, 2, 3], spans), SERVER)
    assert SERVER in str(info.value)


def test_bad_replies_name_the_field():
    ok_spans = [{"version": "1", "start": 0, "end": 2}]
    with pytest.raises(ServerProtocolError, match="finish_reason"):
        parse_generate_reply(_reply([1, 2], ok_spans, finish="weird"), SERVER)
    bad = _reply([1, 2], ok_spans)
    bad["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(ServerProtocolError, match=r"output_token_logprobs\[1\] is for token 99"):
        parse_generate_reply(bad, SERVER)
    with pytest.raises(ServerProtocolError, match="lacks 'output_ids'"):
        parse_generate_reply({"error": "x"}, SERVER)


def test_scoring_asks_for_a_prefill_and_checks_the_positions():
    ids = [5, 6, 7, 8]
    p = score_payload([ids, [9, 10]], [2, 1], "s-1")
    assert p["input_ids"] == [ids, [9, 10]] and p["logprob_start_len"] == [1, 0]
    assert p["sampling_params"]["max_new_tokens"] == 0 and p["rid"] == "s-1"
    first = {"meta_info": {"input_token_logprobs": [[None, 6, None], [-0.5, 7, None],
                                                    [-1.25, 8, None]], "weight_version": "3"}}
    second = {"meta_info": {"input_token_logprobs": [[None, 9], [-2.0, 10]],
                            "weight_version": "3"}}

    def parse(*items, seqs=(ids, [9, 10]), starts=(2, 1)):
        return parse_score_reply(list(items), SERVER, "s-1", list(seqs), list(starts))

    got = parse(first, second)
    assert got.logprobs == [[-0.5, -1.25], [-2.0]] and got.versions == [3, 3, 3]
    with pytest.raises(ServerProtocolError, match="scoring reply has 1 entries; expected a "
                                                  "list of 2"):
        parse(first)
    with pytest.raises(ServerProtocolError, match=r"rid=s-1_0: .*has 2 entries; expected 3"):
        parse({"meta_info": {"input_token_logprobs": [[None, 6], [-0.5, 7]]}}, second)
    wrong = {"meta_info": {"input_token_logprobs": [[None, 6], [-0.5, 9], [-1.0, 8]]}}
    with pytest.raises(ServerProtocolError, match=r"position 2 is for token 9, but "
                                                  r"input_ids\[2\] = 7"):
        parse(wrong, second)
    positive = {"meta_info": {"input_token_logprobs": [[None, 6], [0.5, 7], [-1.0, 8]]}}
    with pytest.raises(ServerProtocolError, match=r"input_token_logprobs\[2\] has "
                                                  r"log-probability 0.5"):
        parse(positive, second)
    # SGLang reports the vocabulary's last id as 0: accepted only for the request's top id
    clipped = {"meta_info": {"input_token_logprobs": [[None, 6], [-0.5, 0], [-1.0, 8]]}}
    assert parse(clipped, seqs=([5, 6, 511, 8],), starts=(2,)).logprobs == [[-0.5, -1.0]]
    with pytest.raises(ServerProtocolError, match=r"position 2 is for token 0"):
        parse(clipped, seqs=(ids,), starts=(2,))  # 7 is not the top id: a real error
    with pytest.raises(ValueError, match="start=4 must be in"):
        score_payload([ids], [4], "s-2")


def test_payload_is_token_in_with_logprobs():
    g = GenerationHyperparameters(greedy=True, temperature=0.7, stop_token_ids=[2])
    p = generate_payload([1, 2, 3], g, "rid-1", max_new_tokens=8, min_new_tokens=1)
    assert p["input_ids"] == [1, 2, 3] and p["rid"] == "rid-1" and p["return_logprob"]
    sp = p["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["max_new_tokens"] == 8 and sp["min_new_tokens"] == 1
    assert sp["stop_token_ids"] == [2] and sp["no_stop_trim"] is True


def test_a_group_is_one_batched_request_with_a_rid_and_seed_per_sample():
    g = GenerationHyperparameters(temperature=1.0, max_new_tokens=6)
    singles = [{**generate_payload([5, 6, 7], g, f"grp-{i}", 6, 0, seed=10 + i),
                "lora_path": "policy"} for i in range(3)]
    p = group_payload(singles)
    assert p["input_ids"] == [[5, 6, 7]] * 3 and p["rid"] == ["grp-0", "grp-1", "grp-2"]
    assert [sp["sampling_seed"] for sp in p["sampling_params"]] == [10, 11, 12]
    assert p["lora_path"] == ["policy"] * 3 and p["return_logprob"] is True
    assert p["stream"] is False
    with pytest.raises(ValueError, match="no images"):
        group_payload([{**singles[0], "image_data": ["png"]}])
    reply = {"output_ids": [9], "meta_info": {"output_token_logprobs": [[-0.5, 9]],
                                               "finish_reason": {"type": "length"},
                                               "weight_version": "3"}}
    group = parse_group_reply([reply, reply, reply], "s:1", p["rid"])
    assert [r.output_ids for r in group.replies] == [[9]] * 3 and group.versions == [3] * 3
    with pytest.raises(ServerProtocolError, match="a list of 2; expected a list of 3"):
        parse_group_reply([reply, reply], "s:1", p["rid"])
    with pytest.raises(ServerProtocolError, match="rid=grp-1"):  # names the bad sample
        parse_group_reply([reply, {"output_ids": [9]}, reply], "s:1", p["rid"])


def test_server_pool_least_inflight_sticky_and_avoids_failed():
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pool = ServerPool([a, b])
    pool.inflight[a] = 3
    assert pool.choose("r1") == b  # fewest in flight
    pool.inflight[b] = 5
    assert pool.choose("r1") == b  # sticky by rid
    assert pool.choose("r2") == a
    pool.mark_failed(b)  # b just failed: r1 moves away from it
    assert pool.choose("r1") == a
    assert pool.choose("r3", exclude=frozenset({a})) == b  # the only one left


def test_round_robin_and_all_failed():
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pool = ServerPool([a, b], policy="round_robin")
    pool.inflight[b] = 9
    assert [pool.choose(f"k{i}") for i in range(4)] == [a, b, a, b]
    pool.failed_at[a] = time.monotonic() - 1
    pool.failed_at[b] = time.monotonic()
    assert pool.choose("k9") == a  # every server failed recently: the least recent one
    with pytest.raises(ValueError, match="schedule policy"):
        ServerPool([a], policy="random")


def test_servers_out_of_service_get_nothing_until_put_back():
    a, b, c = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
    pool = ServerPool([a, b])
    assert pool.choose("r1") == a
    assert pool.take_out(a, "died") and not pool.take_out(a, "again")  # reported once
    assert [pool.choose(f"k{i}") for i in range(4)] == [b] * 4
    assert pool.choose("r1") == b  # its sticky server is out: moved, even when excluded
    assert pool.choose("r2", exclude=frozenset({b})) == b
    pool.take_out(b, "failed to load weights")
    with pytest.raises(NoServerInServiceError, match=r"127.0.0.1:1: died; 127.0.0.1:2: failed"):
        pool.choose("r3")
    pool.add(c, reason="new: loading the current weights")  # joins out of service
    assert pool.in_service() == []
    pool.put_back(c)
    pool.put_back(a)
    assert pool.in_service() == [a, c] and pool.choose("r3") in (a, c)


def test_requests_sharing_a_rid_are_sent_under_distinct_ones():
    pool = ServerPool(["a:1"])
    first, second, third = (pool.claim_rid("r") for _ in range(3))
    assert (first, second, third) == ("r", "r~1", "r~2")
    pool.release_rid("r~1")
    assert pool.claim_rid("r") == "r~1"  # freed ids are reused; in-flight ones never
    pool.release_rid("r")
    assert pool.claim_rid("r") == "r"


def test_a_reply_older_than_the_weights_its_server_held_takes_the_server_out():
    """The floor is the version every server in service held when the request was sent; a
    request in flight across an update starts at that version and ends at a newer one."""
    from engines.fleet.membership import FleetMembership
    from engines.fleet.routing import OwnAborts
    from engines.sglang.api import SGLangAPI

    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pool = ServerPool([a, b])
    membership = FleetMembership(rollout_config(server_addrs=[a, b]), pool,
                                 session=lambda: None, on_fatal=lambda e: None,  # type: ignore
                                 api=SGLangAPI(), own_aborts=OwnAborts())
    assert membership.served_version() is None
    assert membership.lost_weights(a, [0, 0], None) is None  # before any update: nothing known
    assert membership.lost_weights(a, [], 3) is None  # no tokens: no evidence
    assert membership.lost_weights(a, [3, 3, 4, 4], 3) is None  # across an update: kept
    assert membership.lost_weights(a, [5], 3) is None
    error = membership.lost_weights(b, [0, 0, 0], 3)
    assert error is not None and b in str(error) and "version 0" in str(error)
    assert pool.in_service() == [a] and "held version 3" in pool.out_of_service[b]
    assert membership.counts["taken_out"] == 1


def test_scoring_with_top_k_reads_each_positions_most_likely_tokens():
    ids = [5, 6, 7, 8]
    p = score_payload([ids], [2], "s-3", top_k=2)
    assert p["top_logprobs_num"] == 2 and "top_logprobs_num" not in score_payload([ids], [2], "s")
    top = [None, [[-0.1, 7, None], [-2.5, 3, None]], [[-0.2, 4, None], [-1.0, 8, None]]]
    item = {"meta_info": {"input_token_logprobs": [[None, 6], [-0.1, 7], [-1.0, 8]],
                          "input_top_logprobs": top, "weight_version": "1"}}
    got = parse_score_reply([item], SERVER, "s-3", [ids], [2], top_k=2)
    assert got.logprobs == [[-0.1, -1.0]]
    (one,) = got.scores
    assert one.top_ids == [[7, 3], [4, 8]] and one.top_logprobs == [[-0.1, -2.5], [-0.2, -1.0]]
    assert parse_score_reply([item], SERVER, "s-3", [ids], [2]).scores[0].top_ids == []
    short = {"meta_info": {**item["meta_info"], "input_top_logprobs": top[:2]}}
    with pytest.raises(ServerProtocolError, match="input_top_logprobs has 2 entries; expected 3"):
        parse_score_reply([short], SERVER, "s-3", [ids], [2], top_k=2)
    twice = {"meta_info": {**item["meta_info"],
                           "input_top_logprobs": [None, top[1], [[-0.2, 4], [-1.0, 4]]]}}
    with pytest.raises(ServerProtocolError, match=r"input_top_logprobs\[2\] has token ids "
                                                  r"\[4, 4\]"):
        parse_score_reply([twice], SERVER, "s-3", [ids], [2], top_k=2)
    with pytest.raises(ServerProtocolError, match=r"input_top_logprobs\[1\] = .*expected 3"):
        parse_score_reply([item], SERVER, "s-3", [ids], [2], top_k=3)
    with pytest.raises(ValueError, match="top_k=-1 must be an integer >= 0"):
        score_payload([ids], [2], "s", top_k=-1)


def test_routed_experts_are_asked_for_decoded_and_required_when_asked():
    import base64

    import numpy as np

    from engines.fleet.backends import server_api

    g = GenerationHyperparameters(max_new_tokens=2)
    api = server_api("sglang", routed_experts=True)
    payloads = [api.generate_payload([1, 2, 3], g, f"r{i}", 2, 0, seed=i) for i in range(2)]
    assert payloads[0]["return_routed_experts"] is True
    assert group_payload(payloads)["return_routed_experts"] is True  # once for the batch
    assert "return_routed_experts" not in server_api("sglang").generate_payload(
        [1, 2, 3], g, "r", 2, 0)
    experts = np.arange(4 * 3 * 2, dtype="<i4")  # 4 positions x 3 layers x top-2
    reply = _reply([7, 8], [{"version": "0", "start": 0, "end": 2}])
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    parsed = api.parse_generate_reply(reply, SERVER, "r0")
    assert parsed.routed_experts.tolist() == experts.tolist()
    del reply["meta_info"]["routed_experts"]
    with pytest.raises(ServerProtocolError, match="--enable-return-routed-experts"):
        api.parse_generate_reply(reply, SERVER, "r0")
    reply["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(ServerProtocolError, match="routed_experts is not base64"):
        api.parse_generate_reply(reply, SERVER, "r0")
    with pytest.raises(ValueError, match="rollout.return_routed_experts with a vllm fleet"):
        server_api("vllm", routed_experts=True)


def test_router_replay_makes_the_fleet_record_routing_and_refuses_vllm():
    from pathlib import Path

    from areal_like.api.config_loader import load_config
    from recipes.configs import GRPOConfig

    config = load_config(GRPOConfig, Path("recipes/conf/grpo_addition.yaml").resolve(),
                         ["model.path=/m", "actor.moe.router_replay=true"])
    assert config.rollout.return_routed_experts  # every reply carries the routing
    assert config.server.extra_args.count("--enable-return-routed-experts") == 1
    attached = load_config(GRPOConfig, Path("recipes/conf/grpo_addition.yaml").resolve(),
                           ["model.path=/m", "rollout.return_routed_experts=true",
                            "rollout.server_addrs=[127.0.0.1:1]"])
    assert "--enable-return-routed-experts" not in attached.server.extra_args  # not ours
    with pytest.raises(Exception, match="router_replay.*with a vllm fleet"):
        load_config(GRPOConfig, Path("recipes/conf/grpo_addition.yaml").resolve(),
                    ["model.path=/m", "actor.moe.router_replay=true", "server.backend=vllm"])
