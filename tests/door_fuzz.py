"""Hostile requests for the services that outside programs call (the Tinker API, the agent
gateway): hypothesis strategies for JSON bodies built from the fields the endpoints read, with
values of every wrong type and size, and the one check every reply must pass — a 4xx with a
message, never a 5xx, never a dropped connection. Deterministic (`derandomize`): every run
makes the same requests; AREAL_LIKE_FUZZ_EXPLORE explores others."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# bounded in time: each example is one request (and its future's result), most answered in
# milliseconds; no example database (a repository folder nobody reviews).
# AREAL_LIKE_FUZZ_EXPLORE=N: N examples from a random seed (`--hypothesis-seed` repeats one)
_EXPLORE = int(os.environ.get("AREAL_LIKE_FUZZ_EXPLORE", "0"))
FUZZ_SETTINGS = settings(max_examples=_EXPLORE or 150, deadline=None, derandomize=not _EXPLORE,
                         database=None, suppress_health_check=list(HealthCheck))
REPLY_TIMEOUT_S = 120.0  # one request: a hang is a failure, not a slow machine

HOSTILE_STRINGS = ["", " ", "\x00", "../../etc/passwd", "tinker://x/weights/../../y",
                   "a" * 5000, "☃" * 50, "-1", "1e309", "NaN", "null", "{}", "[]",
                   "Qwen/Qwen3.5-9B-Base", "tml-someone-else"]
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**9, -(10**9)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(HOSTILE_STRINGS))
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.text(max_size=12), inner, max_size=5), max_leaves=16)


def bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """An endpoint's body: an object of some of its `fields` (each with its own values or any
    hostile value) and stray keys; sometimes not an object at all."""
    field_values = {k: v | JSON_VALUES for k, v in fields.items()}
    objects = st.fixed_dictionaries({}, optional=field_values).flatmap(
        lambda known: st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=2).map(
            lambda stray: {**stray, **known}))
    return st.one_of(objects, objects, objects, JSON_VALUES)


_LEFT_OUT = object()


def _mutate(body: dict[str, Any], changes: list[tuple[str, Any]]) -> dict[str, Any]:
    body = dict(body)
    for key, value in changes:
        if value is _LEFT_OUT:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def near(template: dict[str, st.SearchStrategy[Any]],
         optional: dict[str, st.SearchStrategy[Any]] | None = None
         ) -> st.SearchStrategy[dict[str, Any]]:
    """A body as a client sends it (`template`: a strategy per field, the valid values;
    `optional`: fields it may send), with at most two fields left out or given any hostile
    value: calls that pass most checks and meet the one that must catch them (a body of
    nothing but noise stops at the first)."""
    keys = sorted({**template, **(optional or {})})
    changes = st.lists(st.tuples(st.sampled_from(keys), st.just(_LEFT_OUT) | JSON_VALUES),
                       max_size=2)
    return st.builds(_mutate, st.fixed_dictionaries(template, optional=optional or {}),
                     changes)


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bytes that are not JSON, or JSON cut short."""
    return st.one_of(st.binary(max_size=200), st.sampled_from(
        [b"", b"{", b'{"a": ', b"\xff\xfe", b"[" * 5000, b'{"a": 1}' * 3]))


@dataclass
class Reply:
    status: int
    body: Any  # the decoded JSON (None: not JSON)
    text: str


def send(method: str, url: str, data: bytes | None, headers: dict[str, str]) -> Reply:
    """One request; an HTTP error status is a reply, a dropped connection or a timeout is
    not (it raises)."""
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    return Reply(status, body, text)


def json_bytes(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def assert_refused_or_served(reply: Reply, what: str, message_key: str) -> None:
    """A reply to a hostile request: served (2xx), or refused with a 4xx whose JSON body
    says why under `message_key` (a dotted path: "error.message"). Never a 5xx: the service
    caught something the boundary should have refused."""
    assert reply.status < 500, f"{what}: {reply.status} {reply.text[:600]}"
    if reply.status == 400 and reply.body is None and "bytes when reading" in reply.text:
        return  # aiohttp's HTTP parser, before any route: a request line past 8 KiB, in text
    if reply.status >= 400:
        message: Any = reply.body
        for key in message_key.split("."):
            message = message.get(key) if isinstance(message, dict) else None
        assert isinstance(message, str) and message.strip(), \
            f"{what}: {reply.status} without a message under {message_key!r}: {reply.text[:600]}"
