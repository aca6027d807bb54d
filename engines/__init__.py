"""Backends. `fleet/`: the backend-neutral client of an inference fleet and the launcher of
local servers; `server/`: what every server speaks (the `ServerAPI` interface, HTTP, replies,
errors); `sglang/` and `vllm/`: one folder per backend; `weight_transport/`: both ends of the
process-group weight transport; `fsdp/`: the FSDP2 train engine.

Imports are lazy so that `import engines` stays cheap and a missing optional backend only
fails when it is used.
"""

from __future__ import annotations

from typing import Any

from areal_like.lazy import LazyExports

_LAZY = LazyExports(__name__, {
    "RemoteInferenceEngine": "engines.fleet.client",
    "RemoteSGLangEngine": "engines.fleet.client",
    "RemoteVLLMEngine": "engines.fleet.client",
    "InferenceFleet": "engines.fleet.launch",
    "SGLangFleet": "engines.sglang_server",  # the old name of InferenceFleet
    "FSDPEngine": "engines.fsdp.engine",
})

__all__ = sorted(_LAZY.names)


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.dir()
