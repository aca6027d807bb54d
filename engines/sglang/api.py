"""SGLang's HTTP API (`ServerAPI`)."""

from __future__ import annotations

from typing import Any, Optional

import aiohttp

from areal_like.api.io_struct import GenerationHyperparameters
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError, ServerProtocolError
from engines.server.http import (
    CONTROL_TIMEOUT_S,
    GENERATION_PROBE_TIMEOUT_S,
    RETRYABLE,
    get_answers,
    get_json,
    post_json,
)
from engines.server.replies import GenerateReply, GroupReply, ScoreReply
from engines.sglang import weight_files
from engines.sglang.protocol import (
    generate_payload,
    group_payload,
    parse_generate_reply,
    parse_group_reply,
    parse_score_reply,
    score_payload,
)


class SGLangAPI(ServerAPI):
    name = "SGLang"
    generate_path = "/generate"
    can_return_routed_experts = True  # servers started with --enable-return-routed-experts

    def generate_payload(self, input_ids: list[int], gconfig: GenerationHyperparameters,
                         rid: str, max_new_tokens: int, min_new_tokens: int,
                         seed: Optional[int] = None) -> dict[str, Any]:
        payload = generate_payload(input_ids, gconfig, rid, max_new_tokens, min_new_tokens,
                                   seed)
        if self.routed_experts:
            payload["return_routed_experts"] = True
        return payload

    def add_images(self, payload: dict[str, Any], image_data: list[str]) -> dict[str, Any]:
        # SGLang's processor expands each image pad of `input_ids` itself; ids sent already
        # expanded hang the request in SGLang 0.5.23 (see areal_like/models/vision.py).
        return {**payload, "image_data": list(image_data)}

    def name_adapter(self, payload: dict[str, Any], adapter: str) -> dict[str, Any]:
        # a batch (several input_ids lists) names its adapter once per sequence
        batch = payload["input_ids"] and isinstance(payload["input_ids"][0], list)
        return {**payload, "lora_path": [adapter] * len(payload["input_ids"]) if batch
                else adapter}

    def parse_generate_reply(self, data: Any, server: str, rid: str) -> GenerateReply:
        return self._with_routing(parse_generate_reply(data, server, rid), server, rid)

    def _with_routing(self, reply: GenerateReply, server: str, rid: str) -> GenerateReply:
        if self.routed_experts and reply.routed_experts is None:
            raise ServerProtocolError(
                f"SGLang server {server}, rid={rid}: the reply has no meta_info.routed_experts "
                f"(rollout.return_routed_experts): start the servers with "
                f"--enable-return-routed-experts")
        return reply

    def score_payload(self, sequences: list[list[int]], starts: list[int],
                      rid: str, top_k: int = 0) -> dict[str, Any]:
        return score_payload(sequences, starts, rid, top_k)

    def parse_score_reply(self, data: Any, server: str, rid: str, sequences: list[list[int]],
                          starts: list[int], top_k: int = 0) -> ScoreReply:
        return parse_score_reply(data, server, rid, sequences, starts, top_k)

    def set_rid(self, payload: dict[str, Any], rid: str) -> None:
        payload["rid"] = rid

    groups_in_one_request = True

    def group_payload(self, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        return group_payload(payloads)

    def parse_group_reply(self, data: Any, server: str, rids: list[str]) -> GroupReply:
        group = parse_group_reply(data, server, rids)
        for reply, rid in zip(group.replies, rids, strict=True):
            self._with_routing(reply, server, rid)
        return group

    def set_rids(self, payload: dict[str, Any], rids: list[str]) -> None:
        payload["rid"] = list(rids)

    async def answers(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> str:
        return await get_answers(session, addr, "/model_info", timeout)

    def vocabulary_probe(self, token_id: int, rid: str) -> dict[str, Any]:
        # SGLang 0.5.23 does not check prompt ids: one past the vocabulary ends its scheduler
        # (IndexError in the embedding). It does check the ids whose log-probs are asked for.
        payload = self.generate_payload([0], GenerationHyperparameters(greedy=True), rid,
                                        max_new_tokens=1, min_new_tokens=0)
        return {**payload, "return_logprob": True, "token_ids_logprob": [token_id]}

    async def model_identity(self, session: aiohttp.ClientSession,
                             addr: str) -> dict[str, Any]:
        info = await get_json(session, addr, "/model_info")
        keys = ("model_type", "architectures", "is_generation", "has_image_understanding")
        return {k: info.get(k) for k in keys} if isinstance(info, dict) else {}

    async def model_folder(self, session: aiohttp.ClientSession, addr: str) -> Optional[str]:
        info = await get_json(session, addr, "/model_info")  # (the last folder loaded)
        path = info.get("model_path") if isinstance(info, dict) else None
        return path if isinstance(path, str) else None

    async def generates(self, session: aiohttp.ClientSession, addr: str,
                        timeout: float) -> str:
        # /health_generate succeeds as soon as the server emits any output (its one-token
        # probe or another request's); it gives up by itself after health_generate_timeout
        # (server.health_generate_timeout, the server's bound: `timeout` is not used here)
        try:
            async with session.get(f"http://{addr}/health_generate", timeout=aiohttp.ClientTimeout(
                    total=GENERATION_PROBE_TIMEOUT_S)) as resp:
                return "" if resp.status == 200 else f"/health_generate: HTTP {resp.status}"
        except RETRYABLE as e:
            return f"/health_generate: {type(e).__name__}: {e}"

    async def pause(self, session: aiohttp.ClientSession, addr: str, mode: str) -> None:
        await post_json(session, addr, "/pause_generation", {"mode": mode}, CONTROL_TIMEOUT_S)

    async def resume(self, session: aiohttp.ClientSession, addr: str) -> None:
        await post_json(session, addr, "/continue_generation", {}, CONTROL_TIMEOUT_S)

    async def abort(self, session: aiohttp.ClientSession, addr: str, rid: str) -> None:
        await post_json(session, addr, "/abort_request", {"rid": rid}, timeout=5.0)

    async def load_from_disk(self, session: aiohttp.ClientSession, addr: str, path: str,
                             version: int, timeout: float) -> None:
        reply = await post_json(session, addr, "/update_weights_from_disk",
                                {"model_path": path, "weight_version": str(version)}, timeout)
        if not (isinstance(reply, dict) and reply.get("success")):
            raise InferenceServerError(f"SGLang server {addr} failed to load weights from "
                                       f"{path}: {reply}")

    async def apply_weight_file(self, session: aiohttp.ClientSession, addr: str, path: str,
                                version: int, timeout: float,
                                model_digest: bool = False) -> dict[str, Any]:
        return await weight_files.apply_weight_file(session, addr, path, version, timeout,
                                                    model_digest)

    async def tp_size(self, session: aiohttp.ClientSession, addr: str) -> int:
        info = await get_json(session, addr, "/get_server_info")
        return int(info.get("tp_size", 1) or 1)

    async def join_group(self, session: aiohttp.ClientSession, addr: str,
                         body: dict[str, Any], timeout: float) -> None:
        await post_json(session, addr, "/init_weights_update_group", body, timeout, retries=0)

    async def leave_group(self, session: aiohttp.ClientSession, addr: str,
                          group_name: str) -> None:
        await post_json(session, addr, "/destroy_weights_update_group",
                        {"group_name": group_name}, CONTROL_TIMEOUT_S, retries=0)

    async def begin_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        await post_json(session, addr, "/begin_weight_update", {}, CONTROL_TIMEOUT_S)

    async def receive_bucket(self, session: aiohttp.ClientSession, addr: str,
                             body: dict[str, Any], timeout: float) -> None:
        await post_json(session, addr, "/update_weights_from_distributed",
                        {**body, "load_format": "flattened_bucket"}, timeout, retries=0)

    async def end_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        await post_json(session, addr, "/end_weight_update", {}, CONTROL_TIMEOUT_S)
