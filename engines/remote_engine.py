"""Old import path of the fleet client (`engines.fleet.client`), kept for code written against
it; the old error names are aliases of the backend-neutral ones."""

from engines.fleet.client import RemoteInferenceEngine, RemoteSGLangEngine, RemoteVLLMEngine
from engines.server.errors import InferenceServerError, ServerProtocolError

RemoteSGLangError = InferenceServerError
SGLangProtocolError = ServerProtocolError

__all__ = ["RemoteInferenceEngine", "RemoteSGLangEngine", "RemoteSGLangError",
           "RemoteVLLMEngine", "SGLangProtocolError"]
