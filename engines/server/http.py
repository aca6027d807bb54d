"""HTTP plumbing shared by the fleet client (every backend): errors, JSON replies, idempotent
control calls."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from engines.server.errors import InferenceServerError

logger = logging.getLogger("engines.fleet.client")

CONTROL_TIMEOUT_S = 30.0  # pause/continue/health calls
# the server gives up by itself first (server.health_generate_timeout)
GENERATION_PROBE_TIMEOUT_S = 60.0
CONTROL_RETRIES = 2  # extra tries of a control call whose connection dropped
# uvicorn closes idle keep-alive connections after 5 s; drop them first ("Server disconnected")
KEEPALIVE_S = 4.0


def open_session(api_key: str | None) -> aiohttp.ClientSession:
    """An HTTP session to a fleet (call on the loop that will use it): `api_key` as a bearer
    token, idle connections dropped before the servers drop them, and no connection limit
    (the caller bounds its concurrency: the executor's max_concurrent_rollouts)."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(connector=connector, headers=headers)


class RetryableHTTPError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")


class MalformedReplyError(Exception):
    """A 200 reply whose body is not JSON (garbage or cut off): retried like a dropped
    connection, then reported naming the server, the endpoint and the body's first bytes."""

    def __init__(self, addr: str, path: str, text: str, error: Exception) -> None:
        super().__init__(f"inference server {addr}: {path} answered HTTP 200 with a body that is "
                         f"not valid JSON ({error}; {len(text)} bytes, starting "
                         f"{text[:200]!r})")


def parse_json_reply(text: str, addr: str, path: str) -> Any:
    if not text.strip():
        return None  # an empty body (some control endpoints), as aiohttp's resp.json()
    try:
        return json.loads(text)
    except ValueError as e:
        raise MalformedReplyError(addr, path, text, e) from None


# Errors after which a request is tried again, on another server when there is one.
RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
             RetryableHTTPError, MalformedReplyError)


async def post_json(session: aiohttp.ClientSession, addr: str, path: str, body: dict[str, Any],
                    timeout: float, retries: int = CONTROL_RETRIES) -> Any:
    """POST a control call. Every control call is idempotent (pause, continue, load the
    same folder under the same version), so a dropped connection is retried: a pooled
    keep-alive connection can be closed by the server just as it is reused. Calls that are
    not idempotent (a bucket received over a process group) pass `retries=0`."""
    for attempt in range(retries + 1):
        try:
            async with session.post(f"http://{addr}{path}", json=body,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise InferenceServerError(f"inference server {addr}: {path} returned HTTP "
                                               f"{resp.status}: {text[:500]}")
                return parse_json_reply(text, addr, path)
        except asyncio.TimeoutError:
            raise InferenceServerError(
                f"inference server {addr}: {path} did not answer within {timeout} s") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                MalformedReplyError) as e:
            if attempt == retries:
                raise InferenceServerError(f"inference server {addr}: {path} failed after "
                                           f"{attempt + 1} tries: {type(e).__name__}: {e}") from e
            logger.warning("%s on %s: %s; retrying", path, addr, e)
            await asyncio.sleep(0.2 * (attempt + 1))
        except aiohttp.ClientError as e:
            raise InferenceServerError(
                f"inference server {addr}: {path} failed: {type(e).__name__}: {e}") from e
    raise AssertionError("unreachable")


async def get_json(session: aiohttp.ClientSession, addr: str, path: str,
                   timeout: float = CONTROL_TIMEOUT_S) -> Any:
    """GET `path`'s JSON; raises naming the server and the status when it is not 200."""
    async with session.get(f"http://{addr}{path}",
                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise InferenceServerError(f"server {addr}: GET {path} returned HTTP {resp.status}")
        return await resp.json(content_type=None)


async def get_answers(session: aiohttp.ClientSession, addr: str, path: str,
                      timeout: float) -> str:
    """'' when GET `path` answers at all (any status), else why not."""
    try:
        async with session.get(f"http://{addr}{path}",
                               timeout=aiohttp.ClientTimeout(total=timeout)):
            return ""
    except RETRYABLE as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
