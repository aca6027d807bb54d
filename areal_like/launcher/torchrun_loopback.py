"""`python -m areal_like.launcher.torchrun_loopback ARGS` is `torchrun ARGS`, except that the
rendezvous store of the static (`--master_addr/--master_port`) rendezvous listens on
`--master_addr` only (127.0.0.1 for the local launcher) instead of on every interface.

torchrun has no option for the store's bind address: `TCPStore` binds `::` unless it is handed
an already-bound socket (`master_listen_fd`), which is what this does.
`tests/test_main_job.py` lists a running job's listening sockets and fails on any other
address, so a torch upgrade that changes this is caught.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main


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


static_tcp_rendezvous.TCPStore = bound_store  # type: ignore[attr-defined]

if __name__ == "__main__":
    sys.exit(main())
