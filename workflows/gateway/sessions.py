"""Agent sessions of the gateway: one recording client (`ArealOpenAI`) per agent run.

A workflow opens a session, hands its URL (or key) to the agent program, and closes it when the
program is done; the closed session's recorded calls become trajectories. A call with an
unknown key, or after its session was closed, is refused (and counted): an agent that
outlives its episode must not add turns nobody will train on. (A closed session's key and
close time stay, a few bytes, to say so.)
"""

from __future__ import annotations

import contextvars
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workflows.openai_client import ArealOpenAI


class UnknownSessionError(KeyError):
    """No session was ever opened with this key."""


class SessionClosedError(RuntimeError):
    """The session was closed (its episode ended) before this call."""


@dataclass
class AgentSession:
    key: str
    client: ArealOpenAI
    # the opener's context (the running episode's): its calls draw the episode's sampling
    # seeds in call order, as an in-process agent's calls do
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    opened: float = field(default_factory=time.time)
    closed: Optional[float] = None  # wall-clock time of the close, for the refusal's message
    invalid_tool_calls: int = 0  # tool calls the model wrote that did not parse

    @property
    def is_open(self) -> bool:
        return self.closed is None


class SessionTable:
    """The gateway's sessions by key. Keys are random (unguessable: an agent cannot reach
    another episode's session). A closed session leaves only its key and close time behind,
    to refuse late calls clearly."""

    def __init__(self) -> None:
        self._sessions: dict[str, AgentSession] = {}
        self._closed: dict[str, float] = {}  # key -> when
        self.counts: Counter[str] = Counter()  # gateway/* statistics

    def open(self, client: ArealOpenAI) -> AgentSession:
        key = "s-" + secrets.token_urlsafe(16)
        session = AgentSession(key, client)
        self._sessions[key] = session
        self.counts["sessions_opened"] += 1
        return session

    def get(self, key: str) -> AgentSession:
        """The open session `key`; UnknownSessionError or SessionClosedError (counted)."""
        session = self._sessions.get(key)
        if session is not None:
            return session
        closed = self._closed.get(key)
        if closed is None:
            self.counts["unknown_session"] += 1
            raise UnknownSessionError(f"no agent session {key!r} on this gateway (a session "
                                      f"key comes from the workflow that opened it)")
        self.counts["calls_after_close"] += 1
        ended = time.strftime("%H:%M:%S", time.localtime(closed))
        raise SessionClosedError(f"agent session {key!r} ended at {ended}: its episode is "
                                 f"over, later calls are not recorded")

    def close(self, key: str) -> AgentSession:
        """End the session: later calls are refused. The caller keeps its recorded calls."""
        session = self.get(key)
        session.closed = time.time()
        del self._sessions[key]
        self._closed[key] = session.closed
        self.counts["sessions_closed"] += 1
        return session

    def __len__(self) -> int:
        """Open sessions."""
        return len(self._sessions)
