"""Who is calling and which request it is: a session, and the models and samplers it made,
belong to the X-API-Key that made it (`CALLER`, set by the app's auth middleware), and so do
its training runs and their checkpoints (the key's fingerprint in each checkpoint); a
`seq_id` sent again is a retry only when its request's digest is the same."""

from __future__ import annotations

import contextvars
import hashlib
import json
from typing import Any, Optional

from areal_like.tinker import fields

# a fingerprint of the request's X-API-Key ("" outside a request)
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("tinker_caller", default="")


def key_fingerprint(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def callers(owner: Optional[str]) -> bool:
    """Whether the caller may see what `owner` (a key fingerprint) made; None: a checkpoint
    saved before owners were recorded, anyone's."""
    return owner is None or owner == CALLER.get()


def request_digest(body: bytes) -> str:
    """What tells a retry (the same request again under its seq_id) from another call."""
    return hashlib.sha256(body).hexdigest()


def seq_id_of(body: dict[str, Any]) -> int:
    return fields.integer(body, "seq_id")


def model_seq_id(body: dict[str, Any]) -> int:
    """The model's number in its session (`<session>:train:<n>`)."""
    return fields.integer(body, "model_seq_id", 0, low=0)


def json_digest(body: dict[str, Any]) -> str:
    return request_digest(json.dumps(body, sort_keys=True, default=str).encode())
