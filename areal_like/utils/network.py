"""Networking helpers."""

from __future__ import annotations

import ipaddress
import random
import socket
import threading
from typing import Optional

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


def bindable(host: str, port: int, reuse_addr: bool = False) -> bool:
    """Whether `port` can be bound on `host` now; `reuse_addr`: as a server that sets
    SO_REUSEADDR would (connections of a dead server in TIME_WAIT do not count)."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
                if port not in _handed_out and bindable(host, port):
                    _handed_out.add(port)
                    return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost` (a name that is not an address: False)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(ip: str) -> Optional[str]:
    """The name of the network interface that holds IPv4 address `ip` (for GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME), or None when no interface has it."""
    if is_loopback(ip):
        return "lo"
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # down, or no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
