"""A torch `TCPStore` whose server socket listens on one address only.

`TCPStore` binds `::` (every interface) unless it is handed an already-bound socket
(`master_listen_fd`); this binds the socket first, so a store meant for loopback stays there.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import TCPStore


def bound_store(host_name: str, port: int, world_size: Optional[int] = None,
                is_master: bool = False, timeout: Optional[timedelta] = None,
                **kwargs: Any) -> TCPStore:
    """A `TCPStore` whose server socket is bound to `host_name` only."""
    if is_master and "master_listen_fd" not in kwargs:
        info = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
        kwargs["master_listen_fd"] = sock.detach()  # the store owns (and closes) it now
    args: list[Any] = [host_name, port, world_size, is_master]
    if timeout is not None:
        args.append(timeout)
    return TCPStore(*args, **kwargs)
