"""What every backend's generation request shares."""

from __future__ import annotations

from typing import Any

from areal_like.api.io_struct import GenerationHyperparameters


def common_sampling_params(gconfig: GenerationHyperparameters) -> dict[str, Any]:
    """Temperature and top-p (greedy: temperature 0, argmax) and the stops, under the names
    both SGLang and vLLM use; each backend adds its own keys (lengths, top-k, seed, log-probs)."""
    params: dict[str, Any] = {
        "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
        "top_p": 1.0 if gconfig.greedy else gconfig.top_p,
        "skip_special_tokens": False,
    }
    if gconfig.stop_token_ids:
        params["stop_token_ids"] = list(gconfig.stop_token_ids)
    if gconfig.stop:
        params["stop"] = list(gconfig.stop)
    return params
