"""One actor of a Ray job as the driver sees it: its node, its process, the copy of its log,
and how it failed."""

from __future__ import annotations

import codecs
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional


class Member:
    """A server or trainer actor; `restarts` counts the times it was brought back."""

    def __init__(self, name: str, role: str, handle: Any, log: Path,
                 bundle: Optional[dict[str, float]] = None) -> None:
        self.name, self.role, self.handle, self.log = name, role, handle, log
        self.bundle = bundle or {}
        self.node: dict[str, Any] = {}
        self.pid: Optional[int] = None
        self.address = ""  # a server's host:port
        self.tail: deque[str] = deque(maxlen=200)
        self.log_file: Any = None  # a TidyLog, opened at its first output
        self.restarts = 0
        self.dead = False  # the actor itself died (Ray may be restarting it)
        self.failure = ""  # how its actor or process failed, until it is brought back
        self.healing: Any = None  # the Future of a server's restart in flight
        self.new_process()

    def new_process(self) -> None:
        """Read the actor's log from its start (a new process, or a restarted actor)."""
        self.offset, self.last_answer = 0, time.monotonic()
        self.pending: Any = None  # the ObjectRef of the poll in flight
        self.partial = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.exit_code: Optional[int] = None

    def where(self) -> str:
        node = self.node
        return (f"{self.name} (node {node.get('ip', '?')}, host {node.get('hostname', '?')}, "
                f"node id {str(node.get('node_id', '?'))[:12]})")

    def last_lines(self, n: int = 20) -> str:
        from engines.fleet.launch import meaningful_lines

        lines = meaningful_lines(list(self.tail), n)
        return "\n".join("    " + line for line in lines) or "    (no output)"

    def record(self) -> dict[str, Any]:
        """Its line of `actors.json`."""
        return {"name": self.name, "role": self.role, "pid": self.pid,
                "restarts": self.restarts, "address": self.address, **self.node}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3])[:600] if lines else type(e).__name__


def cause(e: BaseException) -> str:
    inner = getattr(e, "cause", None)
    return str(inner) if inner is not None else first_line(e)


def exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"
