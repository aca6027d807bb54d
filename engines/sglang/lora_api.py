"""An SGLang fleet that serves the policy as base + one LoRA adapter, swapped at every update.

Every generation and scoring request names the adapter (`lora_path: <adapter name>`), so
the servers run the base weights they started with plus the adapter they hold now. An update
sends only the adapter, through SGLang's own run-time LoRA loading:

| step                      | call                                                        |
|---------------------------|-------------------------------------------------------------|
| pause                     | `/pause_generation {mode: abort}`: requests in flight end   |
|                           | and the client continues them from their tokens afterwards  |
| drop the old adapter      | `/unload_lora_adapter` (when `/v1/models` lists it)         |
| load the new one          | `/load_lora_adapter {lora_path: folder}` (disk), or         |
|                           | `/load_lora_adapter_from_tensors` (in memory, no folder)    |
| label it                  | `/update_weight_version`: every token after it carries it   |
| continue                  | `/continue_generation`                                      |

Why abort and not retract: SGLang unloads an adapter only once no request holds it, and a
retracted request still holds the old one. A request that arrives while the server is
paused waits before SGLang resolves its adapter name, so it gets the new adapter. The name
never changes, so no request can name an adapter a server lacks.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any, Optional

import aiohttp

from areal_like.api.io_struct import (
    AdapterWeights,
    GenerationHyperparameters,
    WeightUpdateMeta,
)
from engines.server.errors import InferenceServerError
from engines.server.http import CONTROL_TIMEOUT_S, get_json, post_json
from engines.sglang.api import SGLangAPI


class SGLangLoRAAPI(SGLangAPI):
    """`SGLangAPI` for a fleet started with `--enable-lora` (server.lora_rank > 0)."""

    update_pause_mode = "abort"

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self._tp_sizes: dict[str, int] = {}
        # the last adapter sent in memory, serialized once for every server of the fleet
        self._serialized: Optional[tuple[AdapterWeights, str]] = None

    def generate_payload(self, input_ids: list[int], gconfig: GenerationHyperparameters,
                         rid: str, max_new_tokens: int, min_new_tokens: int,
                         seed: Optional[int] = None) -> dict[str, Any]:
        payload = super().generate_payload(input_ids, gconfig, rid, max_new_tokens,
                                           min_new_tokens, seed)
        return {**payload, "lora_path": self.adapter}

    def score_payload(self, sequences: list[list[int]], starts: list[int],
                      rid: str, top_k: int = 0) -> dict[str, Any]:
        payload = super().score_payload(sequences, starts, rid, top_k)
        return {**payload, "lora_path": [self.adapter] * len(sequences)}

    async def load_from_disk(self, session: aiohttp.ClientSession, addr: str, path: str,
                             version: int, timeout: float) -> None:
        await self._swap(session, addr, "/load_lora_adapter",
                         {"lora_name": self.adapter, "lora_path": path}, version, timeout,
                         f"the adapter folder {path}")

    async def load_weights(self, session: aiohttp.ClientSession, addr: str,
                           meta: WeightUpdateMeta, timeout: float) -> None:
        if meta.type == "disk":
            await self.load_from_disk(session, addr, str(meta.path), meta.version, timeout)
            return
        if meta.type != "adapter" or meta.adapter is None:
            raise ValueError(f"a LoRA fleet loads adapters (WeightUpdateMeta type 'disk' or "
                             f"'adapter'), not type={meta.type!r}")
        tp_size = await self._tp_size(session, addr)
        body = {"lora_name": self.adapter, "config_dict": meta.adapter.config,
                "serialized_named_tensors": [self._serialize(meta.adapter)] * tp_size}
        await self._swap(session, addr, "/load_lora_adapter_from_tensors", body, meta.version,
                         timeout, f"an in-memory adapter ({meta.adapter.nbytes} bytes)")

    def lost_state(self, status: int, body: str) -> str:
        if status == 400 and "never been loaded" in body and self.adapter in body:
            return f"does not hold LoRA adapter {self.adapter!r} (restarted?)"
        return ""

    async def loaded_adapters(self, session: aiohttp.ClientSession, addr: str) -> list[str]:
        return await loaded_adapters(session, addr)

    def _serialize(self, adapter: AdapterWeights) -> str:
        if self._serialized is None or self._serialized[0] is not adapter:
            self._serialized = (adapter, serialize_tensors(adapter))
        return self._serialized[1]

    async def _tp_size(self, session: aiohttp.ClientSession, addr: str) -> int:
        if addr not in self._tp_sizes:
            self._tp_sizes[addr] = await self.tp_size(session, addr)
        return self._tp_sizes[addr]

    async def _swap(self, session: aiohttp.ClientSession, addr: str, path: str,
                    body: dict[str, Any], version: int, timeout: float, what: str) -> None:
        if self.adapter in await self.loaded_adapters(session, addr):
            reply = await post_json(session, addr, "/unload_lora_adapter",
                                    {"lora_name": self.adapter}, timeout)
            _check(reply, addr, f"could not unload LoRA adapter {self.adapter!r}")
        reply = await post_json(session, addr, path, body, timeout, retries=0)
        _check(reply, addr, f"failed to load {what} as LoRA adapter {self.adapter!r}")
        await post_json(session, addr, "/update_weight_version",
                        {"new_version": str(version), "abort_all_requests": False},
                        CONTROL_TIMEOUT_S)


async def loaded_adapters(session: aiohttp.ClientSession, addr: str) -> list[str]:
    """The adapter names `addr` holds now (SGLang lists them among its models)."""
    models = await get_json(session, addr, "/v1/models")
    listed = models.get("data", []) if isinstance(models, dict) else []
    return [m["id"] for m in listed if isinstance(m, dict) and m.get("parent")]


def serialize_tensors(adapter: AdapterWeights) -> str:
    """The adapter's tensors as SGLang's tensor loader reads them: a pickled dict (plain
    pickle: the tensors' bytes travel in the request, no shared memory), base64."""
    return base64.b64encode(pickle.dumps(adapter.tensors)).decode("ascii")


def _check(reply: Any, addr: str, what: str) -> None:
    if not (isinstance(reply, dict) and reply.get("success")):
        message = reply.get("error_message") if isinstance(reply, dict) else reply
        raise InferenceServerError(f"SGLang server {addr} {what}: {message}")
