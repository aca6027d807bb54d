"""`python -m areal_like.launcher.torchrun_loopback ARGS` is `torchrun ARGS`, except that the
rendezvous store of the static (`--master_addr/--master_port`) rendezvous listens on
`--master_addr` only (127.0.0.1 for the local launcher) instead of on every interface.

torchrun has no option for the store's bind address: `TCPStore` binds `::` unless it is handed
an already-bound socket (`master_listen_fd`), which is what this does.
`tests/test_main_job.py` lists a running job's listening sockets and fails on any other
address, so a torch upgrade that changes this is caught.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main

from areal_like.utils.tcp_store import bound_store

# torchrun's module global (a class) replaced by a function returning a bound TCPStore
static_tcp_rendezvous.TCPStore = bound_store  # type: ignore[misc,assignment]

if __name__ == "__main__":
    sys.exit(main())
