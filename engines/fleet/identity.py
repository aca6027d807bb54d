"""Whether a server that joins a running fleet serves the same model: the backend's own
description of what it loaded (`ServerAPI.model_identity`) against a server in service, and
its vocabulary against the trainer's (`rollout.vocab_size`): a request naming the last token
id is served, one naming the id past it refused (`ServerAPI.vocabulary_probe`: a request each
backend checks without harm)."""

from __future__ import annotations

import uuid
from typing import Optional

import aiohttp

from engines.server.api import ServerAPI
from engines.server.http import CONTROL_TIMEOUT_S


class NotReady(Exception):
    """The server could not be asked (starting, overloaded): ask again later."""


async def mismatch(session: aiohttp.ClientSession, api: ServerAPI, addr: str,
                   peer: Optional[str], vocab_size: int) -> str:
    """Why `addr` does not serve the fleet's model ('' when it does, as far as can be told)."""
    if peer is not None:
        mine, theirs = await api.model_identity(session, addr), \
            await api.model_identity(session, peer)
        differ = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                  if mine.get(k) != theirs.get(k)}
        if differ:
            return "serves another model than " + peer + ": " + ", ".join(
                f"{k} {a!r} (fleet: {b!r})" for k, (a, b) in sorted(differ.items()))
    if vocab_size > 0:
        if (why := await _refuses(session, api, addr, vocab_size - 1)):
            return (f"refused token id {vocab_size - 1} (rollout.vocab_size="
                    f"{vocab_size}): a smaller vocabulary ({why})")
        if not await _refuses(session, api, addr, vocab_size):
            return (f"accepted token id {vocab_size}, past the trainer's "
                    f"vocabulary (rollout.vocab_size={vocab_size}): a larger vocabulary")
    return ""


async def _refuses(session: aiohttp.ClientSession, api: ServerAPI, addr: str,
                   token_id: int) -> str:
    """'' when `addr` generates a token after the prompt [token_id]; its refusal of the id
    (HTTP 400 naming the token id or the vocabulary); raises `NotReady` for any other answer."""
    payload = api.vocabulary_probe(token_id, f"areal-like-vocabulary-{uuid.uuid4().hex[:12]}")
    async with session.post(f"http://{addr}{api.generate_path}", json=payload,
                            timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as resp:
        if resp.status == 200:
            return ""
        body = (await resp.text())[:300]
    if resp.status == 400 and any(w in body.lower() for w in ("token", "vocab")):
        return f"HTTP 400: {body}"
    raise NotReady(f"the vocabulary probe got HTTP {resp.status}: {body}")

