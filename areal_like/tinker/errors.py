"""What a Tinker request can fail with, and how the SDK is told: a direct call answers with the
HTTP status; a future resolves to `{"error": ..., "category": ...}`, which the SDK raises as
`tinker.RequestFailedError` with that category."""

from __future__ import annotations


class TinkerError(Exception):
    status = 500
    category = "server"


class UserError(TinkerError):
    """The request itself is at fault (a bad value, an unsupported option)."""

    status = 400
    category = "user"


class NotFound(TinkerError):
    """An unknown session, model, sampler, future or checkpoint."""

    status = 404
    category = "user"


class Gone(TinkerError):
    """A session that was finished (or reaped after its heartbeats stopped)."""

    status = 410
    category = "user"


class Conflict(TinkerError):
    status = 409
    category = "user"


class Forbidden(TinkerError):
    """Another key's session, model or sampler (answered as 404 where saying that it exists
    would tell a caller about another's work)."""

    status = 403
    category = "user"
