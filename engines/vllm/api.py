"""The fleet client's calls to a vLLM server (>= 0.32, started by `engines/vllm/command.py`:
`VLLM_SERVER_DEV_MODE=1` for its RL endpoints, `--enable-scale-out` for token-in generation,
our weight-transfer engine and worker extension, `engines/vllm/worker/`).

| what                 | vLLM                                                              |
|----------------------|-------------------------------------------------------------------|
| generate / score     | POST /inference/v1/generate (scoring: `prompt_logprobs`)          |
| pause / continue     | POST /pause?mode=abort (keep for pause_mode=in_place) / /resume  |
| load from disk       | POST /collective_rpc areal_like_load_from_disk (vLLM's reload),   |
|                      | /reset_prefix_cache,                                              |
|                      | /update_weight_version                                           |
| weight-update group  | vLLM's weight-transfer API with our engine (engines/vllm/worker/):|
|                      | /init_weight_transfer_engine, /start_weight_update,              |
|                      | /update_weights (a bucket), /finish_weight_update (the version), |
|                      | /shutdown_weight_transfer_engine                                  |
| weight file (delta)  | POST /collective_rpc areal_like_apply_weight_file, then as above  |

vLLM has no retract: a pause for a weight update aborts the requests in flight, and the
client continues each from the tokens it has (`aborts_on_pause`), so every token after the
update is computed from the new weights, as after SGLang's retract.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import aiohttp

from areal_like.api.io_struct import GenerationHyperparameters
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError
from engines.server.http import CONTROL_TIMEOUT_S, RETRYABLE, get_answers, get_json, post_json
from engines.server.replies import GenerateReply, ScoreReply
from engines.vllm import protocol as vllm_protocol

# what a pause does on vLLM for each rollout.client.pause_mode
PAUSE_MODES = {"retract": "abort", "abort": "abort", "in_place": "keep"}


async def _rpc(session: aiohttp.ClientSession, addr: str, method: str,
               kwargs: dict[str, Any], timeout: float, retries: int = 2) -> None:
    """Our method `method` of every worker of the server (vLLM's /collective_rpc; see
    engines/vllm/worker/), bounded by `timeout`; raises naming the server with the errors the
    workers reported."""
    reply = await post_json(session, addr, "/collective_rpc",
                            {"method": method, "kwargs": kwargs, "timeout": timeout},
                            timeout + CONTROL_TIMEOUT_S, retries=retries)
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not results:
        raise InferenceServerError(f"vLLM server {addr}: {method} answered {reply!r}; expected "
                                   f"one result per worker")
    errors = [r for r in results if r != ""]
    if errors:
        raise InferenceServerError(f"vLLM server {addr}: {method} failed: {errors[0]}")


class VLLMAPI(ServerAPI):
    name = "vLLM"
    generate_path = "/inference/v1/generate"
    scores_in_one_request = False

    def __init__(self) -> None:
        self._finishing: dict[str, int] = {}  # server -> the version its update ends with

    def generate_payload(self, input_ids: list[int], gconfig: GenerationHyperparameters,
                         rid: str, max_new_tokens: int, min_new_tokens: int,
                         seed: Optional[int] = None) -> dict[str, Any]:
        return vllm_protocol.generate_payload(input_ids, gconfig, rid, max_new_tokens,
                                              min_new_tokens, seed)

    def parse_generate_reply(self, data: Any, server: str, rid: str) -> GenerateReply:
        return vllm_protocol.parse_generate_reply(data, server, rid)

    def score_payload(self, sequences: list[list[int]], starts: list[int],
                      rid: str, top_k: int = 0) -> dict[str, Any]:
        if len(sequences) != 1 or len(starts) != 1:
            raise ValueError(f"a vLLM scoring request holds one sequence, got {len(sequences)}")
        return vllm_protocol.score_payload(sequences[0], starts[0], rid, top_k)

    def parse_score_reply(self, data: Any, server: str, rid: str, sequences: list[list[int]],
                          starts: list[int], top_k: int = 0) -> ScoreReply:
        return vllm_protocol.parse_score_reply(data, server, rid, sequences[0], starts[0],
                                               top_k)

    def set_rid(self, payload: dict[str, Any], rid: str) -> None:
        payload["request_id"] = rid

    async def answers(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> str:
        return await get_answers(session, addr, "/v1/models", timeout)

    async def model_folder(self, session: aiohttp.ClientSession, addr: str) -> Optional[str]:
        listing = await get_json(session, addr, "/v1/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        root = models[0].get("root") if isinstance(models, list) and models and isinstance(
            models[0], dict) else None
        return root if isinstance(root, str) else None

    async def health(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> str:
        why = await super().health(session, addr, timeout)
        if why:
            return why
        try:
            paused = (await get_json(session, addr, "/is_paused", timeout)).get("is_paused")
        except InferenceServerError as e:  # up, but cannot say: not healthy yet
            return str(e)
        return "paused" if paused else ""

    async def generates(self, session: aiohttp.ClientSession, addr: str,
                        timeout: float) -> str:
        # one token: a server busy with other requests emits it within a step
        body = {"token_ids": [0], "request_id": "health-generate",
                "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        try:
            async with session.post(f"http://{addr}{self.generate_path}", json=body,
                                    timeout=aiohttp.ClientTimeout(
                                        total=timeout)) as resp:
                return "" if resp.status == 200 else f"one-token probe: HTTP {resp.status}"
        except RETRYABLE as e:
            return f"one-token probe: {type(e).__name__}: {e}"

    async def pause(self, session: aiohttp.ClientSession, addr: str, mode: str) -> None:
        await post_json(session, addr, f"/pause?mode={PAUSE_MODES[mode]}", {},
                        CONTROL_TIMEOUT_S)

    def aborts_on_pause(self, mode: str) -> bool:
        return PAUSE_MODES[mode] == "abort"

    async def resume(self, session: aiohttp.ClientSession, addr: str) -> None:
        await post_json(session, addr, "/resume", {}, CONTROL_TIMEOUT_S)

    async def abort(self, session: aiohttp.ClientSession, addr: str, rid: str) -> None:
        await post_json(session, addr, "/abort_requests",
                        {"request_ids": [vllm_protocol.REQUEST_ID_PREFIX + rid]}, timeout=5.0)

    async def _serve_as(self, session: aiohttp.ClientSession, addr: str, version: int) -> None:
        """Drop the prefix cache (its KV came from the old weights), then label new tokens."""
        await post_json(session, addr, "/reset_prefix_cache", {}, CONTROL_TIMEOUT_S)
        await post_json(session, addr, "/update_weight_version", {"new_version": str(version)},
                        CONTROL_TIMEOUT_S)

    async def load_from_disk(self, session: aiohttp.ClientSession, addr: str, path: str,
                             version: int, timeout: float) -> None:
        try:
            await _rpc(session, addr, "areal_like_load_from_disk", {"path": path}, timeout)
        except InferenceServerError as e:
            raise InferenceServerError(f"vLLM server {addr} failed to load weights from {path}: "
                                       f"{e}") from e
        await self._serve_as(session, addr, version)

    async def apply_weight_file(self, session: aiohttp.ClientSession, addr: str, path: str,
                                version: int, timeout: float,
                                model_digest: bool = False) -> dict[str, Any]:
        reply = await post_json(session, addr, "/collective_rpc",
                                {"method": "areal_like_apply_weight_file",
                                 "kwargs": {"path": path, "model_digest": model_digest},
                                 "timeout": timeout}, timeout + CONTROL_TIMEOUT_S, retries=0)
        results = reply.get("results") if isinstance(reply, dict) else None
        try:
            receipts = [json.loads(r) for r in results]  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise InferenceServerError(f"vLLM server {addr}: areal_like_apply_weight_file "
                                       f"answered {reply!r}; expected one receipt per "
                                       f"worker") from None
        if not receipts or any(r.get("applied") != receipts[0].get("applied")
                               for r in receipts):
            raise InferenceServerError(f"vLLM server {addr}: its workers disagree on weight "
                                       f"file {path}: {receipts}")
        if receipts[0].get("applied"):
            await self._serve_as(session, addr, version)
        return dict(receipts[0])

    async def tp_size(self, session: aiohttp.ClientSession, addr: str) -> int:
        return int((await get_json(session, addr, "/get_world_size?include_dp=false"))
                   ["world_size"])

    async def join_group(self, session: aiohttp.ClientSession, addr: str,
                         body: dict[str, Any], timeout: float) -> None:
        init_info = {**{k: body[k] for k in ("master_address", "master_port", "rank_offset",
                                              "world_size", "group_name", "backend")},
                     "timeout_s": timeout}
        await post_json(session, addr, "/init_weight_transfer_engine", {"init_info": init_info},
                        timeout + CONTROL_TIMEOUT_S, retries=0)

    async def leave_group(self, session: aiohttp.ClientSession, addr: str,
                          group_name: str) -> None:
        self._finishing.pop(addr, None)
        await post_json(session, addr, "/shutdown_weight_transfer_engine", {},
                        CONTROL_TIMEOUT_S)

    async def begin_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """Nothing to open for a folder or a weight file (the server is paused)."""

    async def end_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """Nothing to close (see begin_update)."""

    async def begin_group_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """vLLM's weight-transfer session: refused while one is open (as SGLang's). Opening
        and closing it are retried (unlike a bucket): vLLM closes a connection after an error
        reply, and the next call on it is reset unread; one that did run is refused when
        repeated (a second start, a finish without a start), never applied twice."""
        self._finishing.pop(addr, None)
        await post_json(session, addr, "/start_weight_update", {}, CONTROL_TIMEOUT_S)

    async def receive_bucket(self, session: aiohttp.ClientSession, addr: str,
                             body: dict[str, Any], timeout: float) -> None:
        """One bucket, loaded as it arrives; the version is set when the update ends."""
        update_info = {"names": body["names"], "dtype_names": body["dtypes"],
                       "shapes": body["shapes"]}
        await post_json(session, addr, "/update_weights", {"update_info": update_info},
                        timeout + CONTROL_TIMEOUT_S, retries=0)
        if body.get("weight_version") is not None:
            self._finishing[addr] = int(body["weight_version"])

    async def end_group_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """The session closed (the last layers processed), labelled with the version its last
        bucket named; then the prefix cache dropped (its KV came from the old weights)."""
        version = self._finishing.pop(addr, None)
        await post_json(session, addr, "/finish_weight_update",
                        {"weight_version": None if version is None else str(version)},
                        CONTROL_TIMEOUT_S)
        await post_json(session, addr, "/reset_prefix_cache", {}, CONTROL_TIMEOUT_S)
