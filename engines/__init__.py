"""Backends: the inference fleet client/launcher (SGLang or vLLM) and the FSDP2 train engine.

Imports are lazy so that `import engines` stays cheap and a missing optional backend only
fails when it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RemoteInferenceEngine": "engines.remote_engine",
    "RemoteSGLangEngine": "engines.remote_engine",
    "RemoteVLLMEngine": "engines.remote_engine",
    "SGLangFleet": "engines.sglang_server",
    "FSDPEngine": "engines.fsdp_engine",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engines' has no attribute {name!r}")
