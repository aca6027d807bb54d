"""The SGLang HTTP protocol as RemoteSGLangEngine uses it: request payloads and parsed replies.

Pure functions (no I/O), so the wire format is checked in one place. Requests are token-in,
token-out: `input_ids` in, `output_ids` + `meta_info.output_token_logprobs` out, so SGLang's
tokenizer never matters (servers run with --skip-tokenizer-init).
"""

from __future__ import annotations

import base64
import math
from typing import Any, Optional

import numpy as np
import torch

from areal_like.api.io_struct import GenerationHyperparameters, TokenScores
from engines.server.errors import ServerProtocolError
from engines.server.replies import (
    DEFAULT_WEIGHT_VERSION_LABEL,
    LOGPROB_TOLERANCE,
    STOP_REASON_MAP,
    GenerateReply,
    GroupReply,
    ScoreReply,
    check_top_k,
    parse_version_label,
    versions_from_spans,
)
from engines.server.requests import common_sampling_params


def sampling_params(
    gconfig: GenerationHyperparameters, max_new_tokens: int, min_new_tokens: int,
    seed: Optional[int] = None,
) -> dict[str, Any]:
    """SGLang `sampling_params` for one request. Greedy = temperature 0 (argmax).

    `seed` becomes `sampling_seed`, which servers running deterministic inference sample with
    (the draw for each token hashes seed and position); other servers ignore it.
    """
    params = common_sampling_params(gconfig)
    params.update(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                  top_k=1 if gconfig.greedy else gconfig.top_k,
                  no_stop_trim=True)  # the matched stop token is generated and trained on
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def generate_payload(
    input_ids: list[int],
    gconfig: GenerationHyperparameters,
    rid: str,
    max_new_tokens: int,
    min_new_tokens: int,
    seed: Optional[int] = None,
) -> dict[str, Any]:
    return {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params(gconfig, max_new_tokens, min_new_tokens, seed),
        "return_logprob": True,
        "rid": rid,
        "stream": False,
    }


# SGLang takes these once for a whole batch
_REQUEST_FLAGS = ("return_logprob", "stream", "return_routed_experts")


def group_payload(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate payloads of one prompt's samples as one batched `/generate`: SGLang runs each
    as its own request (its own rid and sampling params, so its own seed) and replies with a
    list in the same order. One HTTP round trip and one tokenizer-manager pass for the group."""
    if not payloads or any("image_data" in p for p in payloads) \
            or any(p.keys() != payloads[0].keys() for p in payloads):
        raise ValueError("group_payload: needs payloads with the same keys, and no images")
    # the whole request's flags once; per sample: ids, params, rid (and a LoRA adapter's name)
    return {key: (payloads[0][key] if key in _REQUEST_FLAGS else [p[key] for p in payloads])
            for key in payloads[0]}


def parse_group_reply(data: Any, server: str, rids: list[str]) -> GroupReply:
    """The batched reply of `group_payload`: one checked reply per sample, in order."""
    if not isinstance(data, list) or len(data) != len(rids):
        got = f"a list of {len(data)}" if isinstance(data, list) else type(data).__name__
        raise ServerProtocolError(f"server {server}, rids {rids[0]}..{rids[-1]}: batched "
                                  f"/generate reply is {got}; expected a list of {len(rids)}")
    return GroupReply([parse_generate_reply(d, server, rid)
                       for d, rid in zip(data, rids, strict=True)])


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _logprob_entry(entry: Any, i: int, where: str,
                   field: str = "output_token_logprobs") -> float:
    """The log-probability of entry [logprob, token_id, ...]: a finite number <= 0."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        raise ServerProtocolError(f"{where}: {field}[{i}] = {entry!r}; expected "
                                  "[logprob, token_id, ...]")
    value = entry[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServerProtocolError(f"{where}: {field}[{i}] has log-probability {value!r}; "
                                  f"expected a number")
    if not math.isfinite(value) or value > LOGPROB_TOLERANCE:
        raise ServerProtocolError(f"{where}: {field}[{i}] has log-probability {value!r}; a "
                                  f"log-probability is finite and <= 0")
    return float(value)


def parse_generate_reply(data: Any, server: str, rid: Optional[str] = None) -> GenerateReply:
    where = f"server {server}" + (f", rid={rid}" if rid else "")
    if not isinstance(data, dict) or "output_ids" not in data or "meta_info" not in data:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ServerProtocolError(
            f"{where}: /generate reply lacks 'output_ids'/'meta_info' (got {keys})"
        )
    meta = data["meta_info"]
    if not isinstance(meta, dict) or not isinstance(data["output_ids"], list):
        raise ServerProtocolError(f"{where}: /generate reply has meta_info of type "
                                  f"{type(meta).__name__} and output_ids of type "
                                  f"{type(data['output_ids']).__name__}; expected dict and list")
    try:
        output_ids = [_token_id(t) for t in data["output_ids"]]
    except (TypeError, ValueError) as e:
        raise ServerProtocolError(f"{where}: output_ids are not token ids: {e}") from None
    entries = meta.get("output_token_logprobs")
    if entries is None or len(entries) != len(output_ids):
        got = None if entries is None else len(entries)
        raise ServerProtocolError(
            f"{where}: meta_info.output_token_logprobs has {got} entries for "
            f"{len(output_ids)} output tokens (was return_logprob sent?)"
        )
    logprobs: list[float] = []
    for i, (entry, token) in enumerate(zip(entries, output_ids, strict=True)):
        logprob = _logprob_entry(entry, i, where)
        if int(entry[1]) != token:
            raise ServerProtocolError(
                f"{where}: output_token_logprobs[{i}] is for token {entry[1]} but "
                f"output_ids[{i}] = {token}"
            )
        logprobs.append(logprob)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in STOP_REASON_MAP:
        raise ServerProtocolError(
            f"{where}: meta_info.finish_reason={finish!r}; expected a type in "
            f"{sorted(STOP_REASON_MAP)}"
        )
    versions = versions_from_spans(meta, len(output_ids), server)
    routed = meta.get("routed_experts")
    return GenerateReply(output_ids, logprobs, versions, STOP_REASON_MAP[kind], meta,
                         None if routed is None else decode_routed_experts(routed, where))


def decode_routed_experts(encoded: Any, where: str) -> torch.Tensor:
    """`meta_info.routed_experts`: base64 of little-endian int32, [positions, layers, top_k]
    in C order (SGLang's routed-experts capturer); flat here, the client knows the rows."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (TypeError, ValueError) as e:
        raise ServerProtocolError(f"{where}: meta_info.routed_experts is not base64 ({e})"
                                  ) from None
    if len(raw) % 4:
        raise ServerProtocolError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, "
                                  f"not whole int32 expert ids")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").copy())


def score_payload(sequences: list[list[int]], starts: list[int], rid: str,
                  top_k: int = 0) -> dict[str, Any]:
    """One prefill-only `/generate` for a batch of sequences: the reply holds, per sequence,
    log p(ids[t] | ids[:t]) for t >= start - 1 (SGLang reports the first position of the
    range without a value), and with `top_k` > 0 the k most likely tokens at each of those
    positions. SGLang names the batch's requests `<rid>_<i>`."""
    if len(sequences) != len(starts) or not sequences:
        raise ValueError(f"score: {len(sequences)} sequences and {len(starts)} starts; "
                         f"expected as many, at least one")
    for ids, start in zip(sequences, starts, strict=True):
        if not 1 <= start < len(ids):
            raise ValueError(f"score: start={start} must be in [1, {len(ids)}) (the tokens "
                             f"scored need a prefix and must exist)")
    check_top_k(top_k)
    payload = {
        "input_ids": [list(ids) for ids in sequences],
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": [start - 1 for start in starts],
        "rid": rid,
        "stream": False,
    }
    if top_k:
        payload["top_logprobs_num"] = top_k
    return payload


def parse_score_reply(data: Any, server: str, rid: str, sequences: list[list[int]],
                      starts: list[int], top_k: int = 0) -> ScoreReply:
    """The batch reply of `score_payload` (a list, one entry per sequence), checked."""
    if not isinstance(data, list) or len(data) != len(sequences):
        got = len(data) if isinstance(data, list) else type(data).__name__
        raise ServerProtocolError(f"server {server}, rid={rid}: scoring reply has {got} "
                                  f"entries; expected a list of {len(sequences)}")
    reply = ScoreReply([], [])
    for i, (item, ids, start) in enumerate(zip(data, sequences, starts, strict=True)):
        lps, label = _parse_one_score(item, server, f"{rid}_{i}", ids, start)
        reply.versions += [label] * len(lps)
        top: tuple[list[list[int]], list[list[float]]] = ([], [])
        if top_k:
            top = _parse_top(item["meta_info"], f"server {server}, rid={rid}_{i}", len(lps),
                             top_k)
        reply.scores.append(TokenScores(lps, *top))
    return reply


def _parse_top(meta: dict[str, Any], where: str, n_scored: int, top_k: int
               ) -> tuple[list[list[int]], list[list[float]]]:
    """`input_top_logprobs` of the scored positions (its first entry, the position before
    the range, has none): per position k entries [logprob, token_id, ...], distinct ids."""
    entries = meta.get("input_top_logprobs")
    if not isinstance(entries, list) or len(entries) != n_scored + 1:
        got = len(entries) if isinstance(entries, list) else None
        raise ServerProtocolError(f"{where}: meta_info.input_top_logprobs has {got} entries; "
                                  f"expected {n_scored + 1} (was top_logprobs_num sent?)")
    ids_out: list[list[int]] = []
    lps_out: list[list[float]] = []
    for i, position in enumerate(entries[1:]):
        field_name = f"input_top_logprobs[{i + 1}]"
        if not isinstance(position, list) or len(position) != top_k:
            raise ServerProtocolError(f"{where}: {field_name} = {position!r}; expected "
                                      f"{top_k} entries [logprob, token_id, ...]")
        lps = [_logprob_entry(entry, j, where, field_name) for j, entry in enumerate(position)]
        ids = [entry[1] for entry in position]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids) \
                or len(set(ids)) != len(ids):
            raise ServerProtocolError(f"{where}: {field_name} has token ids {ids}; expected "
                                      f"{top_k} distinct ids >= 0")
        ids_out.append(ids)
        lps_out.append(lps)
    return ids_out, lps_out


def _parse_one_score(data: Any, server: str, rid: str, input_ids: list[int],
                     start: int) -> tuple[list[float], int]:
    where = f"server {server}, rid={rid}"
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise ServerProtocolError(f"{where}: scoring reply lacks meta_info")
    entries = meta.get("input_token_logprobs")
    want = len(input_ids) - start + 1
    if not isinstance(entries, list) or len(entries) != want:
        got = len(entries) if isinstance(entries, list) else None
        raise ServerProtocolError(
            f"{where}: meta_info.input_token_logprobs has {got} entries; expected {want} "
            f"(positions {start - 1}..{len(input_ids) - 1}: was logprob_start_len sent?)")
    logprobs: list[float] = []
    # SGLang (0.5.23, `_process_input_token_logprobs`) reports the vocabulary's last id,
    # vocab_size - 1, as 0 (its clipping of image-hash ids compares with vocab_size - 1); the
    # log-prob is right. So 0 stands for a sent id only if that id can be the last one: the
    # largest this request holds.
    top = max(input_ids)
    for i, entry in enumerate(entries[1:], start=start):
        logprobs.append(_logprob_entry(entry, i, where, "input_token_logprobs"))
        reported = int(entry[1])
        if reported != input_ids[i] and not (reported == 0 and input_ids[i] == top):
            raise ServerProtocolError(f"{where}: input_token_logprobs for position {i} is for "
                                      f"token {entry[1]}, but input_ids[{i}] = {input_ids[i]}")
    label = meta.get("weight_version", DEFAULT_WEIGHT_VERSION_LABEL)
    return logprobs, parse_version_label(label, server)
