"""Old import path of the fleet launcher (`engines.fleet.launch`), kept for code written
against it: `SGLangFleet` is `InferenceFleet` (it launches vLLM servers too)."""

from engines.fleet.launch import InferenceFleet, resolve_server_python
from engines.server.errors import ServerStartError

SGLangFleet = InferenceFleet
SGLangServerError = ServerStartError
resolve_sglang_python = resolve_server_python

__all__ = ["SGLangFleet", "SGLangServerError", "resolve_sglang_python"]
