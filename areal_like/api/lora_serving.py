"""What `actor.lora` means for the servers and the client: fill their LoRA settings from it
(called by `BaseExperimentConfig.__post_init__`)."""

from __future__ import annotations

from typing import Protocol

from areal_like.api.lora_config import LoRAConfig


class ServerSettings(Protocol):  # the fields of config.ServerConfig used here
    backend: str
    lora_rank: int
    lora_target_modules: list[str]


class RolloutSettings(Protocol):  # ... and of config.RolloutConfig (config.py imports this)
    backend: str
    lora_adapter: str


def serve_actor_lora(lora: LoRAConfig, server: ServerSettings,
                     rollout: RolloutSettings) -> None:
    """With actor.lora on, the servers serve base + adapter: fill their LoRA settings (in
    place) and refuse what cannot serve it."""
    if not lora.enabled:
        return
    if rollout.backend == "vllm" or server.backend == "vllm":
        raise ValueError("actor.lora.rank > 0 with a vLLM fleet (server.backend / rollout."
                         "backend = vllm): adapter serving is built for SGLang only so far; "
                         "use server.backend=sglang or actor.lora.rank=0")
    server.lora_rank = max(server.lora_rank, lora.rank)
    server.lora_target_modules = server.lora_target_modules or list(lora.target_modules)
    missing = sorted(set(lora.target_modules) - set(server.lora_target_modules))
    if missing:
        raise ValueError(f"actor.lora.target_modules names {missing}, which "
                         f"server.lora_target_modules={server.lora_target_modules} lacks")
    rollout.lora_adapter = rollout.lora_adapter or lora.adapter_name
