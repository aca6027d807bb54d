"""Errors of an inference server, whatever its backend."""

from __future__ import annotations


class ServerProtocolError(RuntimeError):
    """A server reply does not have the expected shape (names the server and the field)."""


class InferenceServerError(RuntimeError):
    """A request or control call to an inference server failed; the message names the server."""


class ServerStartError(RuntimeError):
    """A server could not be started (the message includes the tail of its log)."""
