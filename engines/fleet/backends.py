"""Which `ServerAPI` a fleet client speaks: per backend, and for a fleet serving LoRA."""

from __future__ import annotations

from areal_like.api.config import BACKENDS
from engines.server.api import ServerAPI
from engines.sglang.api import SGLangAPI
from engines.sglang.lora_api import SGLangLoRAAPI
from engines.vllm.api import VLLMAPI


def server_api(backend: str, lora_adapter: str = "", routed_experts: bool = False) -> ServerAPI:
    """The HTTP API of `backend` ("sglang" or "vllm"); with `lora_adapter`, of a fleet that
    serves the policy as base + that LoRA adapter; with `routed_experts`, whose replies carry
    a mixture of experts' routing."""
    api = _server_api(backend, lora_adapter)
    if routed_experts and not api.can_return_routed_experts:
        raise ValueError(f"rollout.return_routed_experts with a {backend} fleet: its replies "
                         f"cannot carry routed experts here (docs/algorithms.md, router "
                         f"replay); use server.backend=sglang")
    api.routed_experts = routed_experts
    return api


def _server_api(backend: str, lora_adapter: str) -> ServerAPI:
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
