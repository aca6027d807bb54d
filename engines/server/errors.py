"""Errors of an inference server, whatever its backend."""

from __future__ import annotations

from areal_like.api.errors import RequestRejected


class ServerProtocolError(RuntimeError):
    """A server reply does not have the expected shape (names the server and the field)."""


class InferenceServerError(RuntimeError):
    """A request or control call to an inference server failed; the message names the server."""


class RequestRejectedError(InferenceServerError, RequestRejected):
    """The server refused the request itself (HTTP 4xx: past the context, an invalid field):
    any server would, so it is not retried, and it is the caller's error, not the fleet's."""

    def __init__(self, message: str, status: int = 400) -> None:  # (a default: unpickled)
        super().__init__(message)
        self.status = status


class PoisonRequestError(RequestRejectedError):
    """Servers died twice while serving this one request: the request is taken to be the
    cause and is not sent again (a poison request costs one error, not every restart)."""


class ServerStartError(RuntimeError):
    """A server could not be started (the message includes the tail of its log)."""
