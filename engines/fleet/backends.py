"""Which `ServerAPI` a fleet client speaks: per backend, and for a fleet serving LoRA."""

from __future__ import annotations

from areal_like.api.config import BACKENDS
from engines.server.api import ServerAPI
from engines.sglang.api import SGLangAPI
from engines.sglang.lora_api import SGLangLoRAAPI
from engines.vllm.api import VLLMAPI


def server_api(backend: str, lora_adapter: str = "") -> ServerAPI:
    """The HTTP API of `backend` ("sglang" or "vllm"); with `lora_adapter`, of a fleet that
    serves the policy as base + that LoRA adapter."""
    apis: dict[str, type[ServerAPI]] = {"sglang": SGLangAPI, "vllm": VLLMAPI}
    if backend not in apis:
        raise ValueError(f"inference backend {backend!r}: expected one of {BACKENDS} "
                         f"(server.backend / rollout.backend)")
    if lora_adapter:
        if backend != "sglang":
            raise ValueError(f"rollout.lora_adapter={lora_adapter!r} with a {backend} fleet: "
                             f"LoRA adapters are served by SGLang fleets only so far")
        return SGLangLoRAAPI(lora_adapter)
    return apis[backend]()
