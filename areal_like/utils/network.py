"""Networking helpers."""

from __future__ import annotations

import random
import socket
import threading

# Ports for children that bind them only later (servers, torchrun's store). They come from
# below the kernel's ephemeral range: bind(0) and outgoing connections only take ports from
# that range, so between our check and the child's bind nothing but another explicit bind can
# take the port. SGLang draws its internal ports from 22000-29999; this range avoids them.
LOW_PORT, HIGH_PORT = 20000, 21999
_handed_out: set[int] = set()
_rng = random.Random()  # not the global RNG: recipes seed that, and every run would collide
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, that this process has not handed out before, chosen below
    the ephemeral range (see above); falls back to one the OS picks."""
    with _lock:
        if _ephemeral_low() > HIGH_PORT:
            candidates = _rng.sample(range(LOW_PORT, HIGH_PORT + 1), 64)
            for port in candidates:
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
