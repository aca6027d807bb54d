"""Networking helpers."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
