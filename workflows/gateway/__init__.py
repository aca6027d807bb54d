"""The agent gateway: OpenAI-compatible HTTP endpoints for agent programs we do not rewrite,
each session recorded token-in/token-out for training (`server.py`)."""

from workflows.gateway.openai_api import BadRequest
from workflows.gateway.server import AgentGateway
from workflows.gateway.sessions import (
    AgentSession,
    SessionClosedError,
    SessionTable,
    UnknownSessionError,
)

__all__ = ["AgentGateway", "AgentSession", "BadRequest", "SessionClosedError", "SessionTable",
           "UnknownSessionError"]
