"""vLLM's wire format as the fleet client checks it (`engines/vllm/protocol.py`, pure
functions): a well-formed reply parses; every malformed one is refused naming the server and
the field, so the client retries it elsewhere instead of training on it."""

from __future__ import annotations

import copy
import math

import pytest

from areal_like.api.io_struct import GenerationHyperparameters
from engines.server.errors import ServerProtocolError
from engines.vllm.protocol import (
    generate_payload,
    parse_generate_reply,
    parse_score_reply,
    score_payload,
)

SERVER = "127.0.0.1:9"


def _reply(ids=(5, 6, 7), logprobs=(-0.5, -1.0, -2.0), finish="length",
           spans=({"version": "3", "start": 0, "end": 3},)) -> dict:
    content = [{"token_id": t, "logprob": lp, "top_logprobs": []}
               for t, lp in zip(ids, logprobs, strict=True)]
    return {"choices": [{"index": 0, "finish_reason": finish, "token_ids": list(ids),
                         "logprobs": {"content": content},
                         "weight_versions": None if spans is None else list(spans)}]}


def test_a_reply_parses_into_tokens_logprobs_versions_and_stop():
    reply = parse_generate_reply(_reply(spans=({"version": "default", "start": 0, "end": 1},
                                               {"version": "4", "start": 1, "end": 3})),
                                 SERVER, "r")
    assert reply.output_ids == [5, 6, 7]
    assert reply.logprobs == [-0.5, -1.0, -2.0]
    assert reply.versions == [0, 4, 4]  # vLLM's start-up label "default" is version 0
    assert reply.stop_reason == "length"


def _broken(field: str) -> dict:
    data = _reply()
    choice = data["choices"][0]
    if field == "no choices":
        data["choices"] = []
    elif field == "token id":
        choice["token_ids"][1] = -1
    elif field == "logprob for another token":
        choice["logprobs"]["content"][1]["token_id"] = 99
    elif field == "positive logprob":
        choice["logprobs"]["content"][0]["logprob"] = 0.5
    elif field == "nan logprob":
        choice["logprobs"]["content"][0]["logprob"] = math.nan
    elif field == "too few logprobs":
        choice["logprobs"]["content"].pop()
    elif field == "finish reason":
        choice["finish_reason"] = "exploded"
    elif field == "no versions":
        choice["weight_versions"] = None
    elif field == "spans with a gap":
        choice["weight_versions"] = [{"version": "3", "start": 0, "end": 1},
                                     {"version": "4", "start": 2, "end": 3}]
    elif field == "version label":
        choice["weight_versions"] = [{"version": "v1", "start": 0, "end": 3}]
    return data


@pytest.mark.parametrize("field", ["no choices", "token id", "logprob for another token",
                                   "positive logprob", "nan logprob", "too few logprobs",
                                   "finish reason", "no versions", "spans with a gap",
                                   "version label"])
def test_a_malformed_reply_is_refused_naming_the_server(field):
    with pytest.raises(ServerProtocolError, match=SERVER):
        parse_generate_reply(_broken(field), SERVER, "r")


def test_the_payload_asks_for_what_the_client_checks():
    g = GenerationHyperparameters(max_new_tokens=8, min_new_tokens=2, temperature=0.7,
                                  stop_token_ids=[3])
    payload = generate_payload([1, 2], g, "rid-1", 8, 2, seed=11)
    params = payload["sampling_params"]
    assert payload["token_ids"] == [1, 2] and payload["request_id"] == "rid-1"
    assert (params["max_tokens"], params["min_tokens"], params["seed"]) == (8, 2, 11)
    assert params["logprobs"] == 0 and params["stop_token_ids"] == [3]
    assert params["temperature"] == 0.7 and params["top_k"] == 0  # -1 (off) is vLLM's 0
    greedy = generate_payload([1], g.new(greedy=True), "r", 4, 0)["sampling_params"]
    assert greedy["temperature"] == 0.0


def test_scoring_reads_the_prompt_logprobs_of_the_sent_tokens():
    ids, start = [1, 5, 6, 7], 2
    assert score_payload(ids, start, "s")["sampling_params"]["prompt_logprobs"] == 0
    data = _reply(ids=(9,), logprobs=(-0.1,), spans=({"version": "2", "start": 0, "end": 1},))
    data["prompt_logprobs"] = [None, {"5": {"logprob": -1.5}}, {"6": {"logprob": -2.5}},
                               {"7": {"logprob": -3.5}}]
    reply = parse_score_reply(data, SERVER, "s", ids, start)
    assert reply.logprobs == [[-2.5, -3.5]] and reply.versions == [2, 2]
    wrong = copy.deepcopy(data)
    wrong["prompt_logprobs"][3] = {"8": {"logprob": -3.5}}  # for a token that was not sent
    with pytest.raises(ServerProtocolError, match="sent token 7"):
        parse_score_reply(wrong, SERVER, "s", ids, start)
    with pytest.raises(ValueError, match="start=4"):
        score_payload(ids, 4, "s")


def test_scoring_with_top_k_keeps_the_k_most_likely_of_each_position():
    ids, start = [1, 5, 6], 1
    assert score_payload(ids, start, "s", top_k=2)["sampling_params"]["prompt_logprobs"] == 2
    data = _reply(ids=(9,), logprobs=(-0.1,), spans=({"version": "2", "start": 0, "end": 1},))
    # vLLM sends the top k and the sent token, a (k+1)-th where it is not among them
    data["prompt_logprobs"] = [None,
                               {"5": {"logprob": -3.0, "rank": 3}, "4": {"logprob": -0.1},
                                "2": {"logprob": -2.9}},
                               {"6": {"logprob": -0.5}, "7": {"logprob": -1.5}}]
    reply = parse_score_reply(data, SERVER, "s", ids, start, top_k=2)
    assert reply.logprobs == [[-3.0, -0.5]]
    assert reply.scores[0].top_ids == [[4, 2], [6, 7]]
    assert reply.scores[0].top_logprobs == [[-0.1, -2.9], [-0.5, -1.5]]
    with pytest.raises(ServerProtocolError, match=r"prompt_logprobs\[2\] has 2 entries; "
                                                  r"expected at least top_k=3"):
        parse_score_reply(data, SERVER, "s", ids, start, top_k=3)
