"""vLLM's token-in / token-out protocol as the fleet client uses it: request payloads and
checked replies (pure functions, no I/O).

Generation goes to `/inference/v1/generate` (vLLM >= 0.32 with `--enable-scale-out`):
`token_ids` in; per choice `token_ids`, `logprobs.content[i].logprob` of each sampled token and
`weight_versions` spans out. Those spans are vLLM's own record of the weights label
(`/update_weight_version`) its engine held at each step, the same rule as SGLang's
`meta_info.weight_versions`. Scoring uses the same endpoint with `prompt_logprobs`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from areal_like.api.io_struct import GenerationHyperparameters, TokenScores
from engines.server.errors import ServerProtocolError
from engines.server.replies import (
    LOGPROB_TOLERANCE,
    STOP_REASON_MAP,
    GenerateReply,
    ScoreReply,
    check_top_k,
    versions_from_spans,
)
from engines.server.requests import common_sampling_params

# vLLM prefixes the request id it reports (and aborts by) with this
REQUEST_ID_PREFIX = "generate-tokens-"


def sampling_params(gconfig: GenerationHyperparameters, max_new_tokens: int,
                    min_new_tokens: int, seed: Optional[int] = None) -> dict[str, Any]:
    """vLLM `SamplingParams` for one request. Greedy = temperature 0 (argmax)."""
    params = common_sampling_params(gconfig)
    params.update(max_tokens=max_new_tokens, min_tokens=min_new_tokens,
                  top_k=0 if gconfig.greedy or gconfig.top_k == -1 else gconfig.top_k,  # 0: off
                  logprobs=0,  # the sampled token's log-prob only
                  include_stop_str_in_output=True)  # the matched stop is generated, trained on
    if seed is not None:
        params["seed"] = int(seed)
    return params


def generate_payload(input_ids: list[int], gconfig: GenerationHyperparameters, rid: str,
                     max_new_tokens: int, min_new_tokens: int,
                     seed: Optional[int] = None) -> dict[str, Any]:
    return {"token_ids": list(input_ids), "request_id": rid,
            "sampling_params": sampling_params(gconfig, max_new_tokens, min_new_tokens, seed)}


def _where(server: str, rid: Optional[str]) -> str:
    return f"vLLM server {server}" + (f", rid={rid}" if rid else "")


def _logprob(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value > LOGPROB_TOLERANCE:
        raise ServerProtocolError(f"{where}: {field} = {value!r}; a log-probability is a "
                                  f"finite number <= 0")
    return float(value)


def _choice(data: Any, where: str) -> dict[str, Any]:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ServerProtocolError(f"{where}: reply has no single choice (got {got})")
    return choices[0]


def parse_generate_reply(data: Any, server: str, rid: Optional[str] = None) -> GenerateReply:
    where = _where(server, rid)
    choice = _choice(data, where)
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                        for t in ids):
        raise ServerProtocolError(f"{where}: choices[0].token_ids = {ids!r}; expected token ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or len(content) != len(ids):
        got = len(content) if isinstance(content, list) else None
        raise ServerProtocolError(f"{where}: choices[0].logprobs.content has {got} entries for "
                                  f"{len(ids)} output tokens (was sampling_params.logprobs sent?)")
    logprobs = []
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        if not isinstance(entry, dict) or entry.get("token_id") != token:
            raise ServerProtocolError(f"{where}: logprobs.content[{i}] = {entry!r} is not for "
                                      f"token_ids[{i}] = {token}")
        logprobs.append(_logprob(entry.get("logprob"), where, f"logprobs.content[{i}].logprob"))
    finish = choice.get("finish_reason")
    if finish not in STOP_REASON_MAP:
        raise ServerProtocolError(f"{where}: finish_reason={finish!r}; expected one of "
                                  f"{sorted(STOP_REASON_MAP)}")
    spans = choice.get("weight_versions")
    if spans is None and ids:
        raise ServerProtocolError(f"{where}: reply has no weight_versions; cannot tell which "
                                  f"weights produced the tokens (vLLM >= 0.32 reports them)")
    meta = {"weight_versions": spans or [], "finish_reason": finish}
    versions = versions_from_spans(meta, len(ids), server)
    return GenerateReply(list(ids), logprobs, versions, STOP_REASON_MAP[finish], meta)


def score_payload(ids: list[int], start: int, rid: str, top_k: int = 0) -> dict[str, Any]:
    """One prefill of `ids` whose reply holds log p(ids[t] | ids[:t]) for every t >= 1
    (`prompt_logprobs`; with `top_k` > 0 also the k most likely tokens there); one token is
    generated (vLLM generates at least one), unused."""
    if not 1 <= start < len(ids):
        raise ValueError(f"score: start={start} must be in [1, {len(ids)}) (the tokens scored "
                         f"need a prefix and must exist)")
    check_top_k(top_k)
    return {"token_ids": list(ids), "request_id": rid,
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k,
                                "logprobs": 0,
                                "detokenize": False}}


def parse_score_reply(data: Any, server: str, rid: str, ids: list[int],
                      start: int, top_k: int = 0) -> ScoreReply:
    """The log-probs of ids[start:] from a `score_payload` reply; their version is that of
    the token generated with them (vLLM labels generated tokens only)."""
    where = _where(server, rid)
    version = parse_generate_reply(data, server, rid).versions[0]
    entries = data.get("prompt_logprobs") if isinstance(data, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else None
        raise ServerProtocolError(f"{where}: prompt_logprobs has {got} entries for {len(ids)} "
                                  f"prompt tokens (was prompt_logprobs sent?)")
    logprobs = []
    for t in range(start, len(ids)):
        entry = entries[t]
        value = entry.get(str(ids[t])) if isinstance(entry, dict) else None
        if not isinstance(value, dict):
            raise ServerProtocolError(f"{where}: prompt_logprobs[{t}] = {entry!r} has no entry "
                                      f"for the sent token {ids[t]}")
        logprobs.append(_logprob(value.get("logprob"), where, f"prompt_logprobs[{t}]"))
    scores = TokenScores(logprobs)
    if top_k:
        top = [_top_entries(entries[t], top_k, where, f"prompt_logprobs[{t}]")
               for t in range(start, len(ids))]
        scores.top_ids = [ids_ for ids_, _ in top]
        scores.top_logprobs = [lps for _, lps in top]
    return ScoreReply([scores], [version] * len(logprobs))


def _top_entries(entry: dict[str, Any], top_k: int, where: str, field: str
                 ) -> tuple[list[int], list[float]]:
    """The k most likely of one position's entries ({token id: {logprob, rank, ...}}: the
    top k and the sent token, which may be a (k+1)-th), most likely first."""
    scored = []
    for key, value in entry.items():
        if not str(key).isdigit() or not isinstance(value, dict):
            raise ServerProtocolError(f"{where}: {field} has entry {key!r}: {value!r}; expected "
                                      f"token id: {{logprob, rank}}")
        scored.append((_logprob(value.get("logprob"), where, f"{field}[{key}]"), int(key)))
    if len(scored) < top_k:
        raise ServerProtocolError(f"{where}: {field} has {len(scored)} entries; expected at "
                                  f"least top_k={top_k} (was prompt_logprobs={top_k} sent?)")
    scored.sort(key=lambda pair: -pair[0])
    return [t for _, t in scored[:top_k]], [lp for lp, _ in scored[:top_k]]
