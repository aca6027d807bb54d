"""The trainer's end of the weight-update process group: rank 0 of a group whose other ranks
are the SGLang servers' tensor-parallel workers (`/init_weights_update_group`).

The group is not a sub-group of the trainer's own (torchrun) world, so it is built the way
SGLang builds its end: a TCP rendezvous at `master_addr:master_port` (this process hosts the
store, as rank 0), a store prefixed with the group name, and a process group of the chosen
backend (gloo on CPU, NCCL on GPU) with a bounded timeout. Weights travel as SGLang's
"flattened bucket": the bytes of a bucket's tensors, concatenated in order, one broadcast per
bucket.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from areal_like.api.io_struct import ParamSpec
from areal_like.utils.tcp_store import bound_store

logger = logging.getLogger("engines.weight_transport.process_group_trainer")


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """Split `specs` (in order) into buckets of at most `bucket_bytes` (a tensor larger than
    that gets a bucket of its own). A tensor starts a new bucket where its byte offset would
    not be a multiple of its element size (SGLang views each slice in place)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    buckets: list[list[ParamSpec]] = []
    size = 0
    for spec in specs:
        if not buckets or size + spec.nbytes > bucket_bytes or size % spec.itemsize:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += spec.nbytes
    return buckets


def flatten_bucket(tensors: Sequence[torch.Tensor], device: torch.device,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bytes of `tensors`, concatenated (SGLang's `FlattenedTensorBucket` layout), in
    `out` (a uint8 buffer at least that large, reused across updates) when given."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if out is not None and out.numel() >= total:
        flat = out[:total]
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[offset:offset + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        offset += n
    return flat


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def host_store(addr: str, timeout_s: float) -> tuple[Any, int]:
    """The TCP store every server's group meets at (this process is its master): the store
    and its port."""
    port = free_port(addr)
    store = bound_store(addr, port, 2, is_master=True, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    return store, port


class WeightUpdateGroup:
    """One rank of a server's weight-update group (see module doc): the trainer is rank 0;
    another rank (a check standing in for a server) receives what rank 0 broadcasts."""

    def __init__(self, group_name: str, store: Any, world_size: int, backend: str,
                 timeout_s: float, rank: int = 0) -> None:
        self.group_name = group_name
        self.world_size = world_size
        self.rank = rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self._store = store
        self._pg: Optional[Any] = None

    def connect(self) -> None:
        """Wait (at most `timeout_s`) for the server's ranks to join."""
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )

        try:
            prefixed = PrefixStore(self.group_name, self._store)  # the prefix SGLang's end uses
            pg, _ = _new_process_group_helper(self.world_size, self.rank, [],
                                              Backend(self.backend),
                                              prefixed, group_name=GroupName(self.group_name),
                                              backend_options=None,
                                              timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise RuntimeError(
                f"weight-update group {self.group_name!r} ({self.backend}, {self.world_size} "
                f"ranks) did not form within {self.timeout_s:.0f} s: {type(e).__name__}: {e}"
            ) from e
        _world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
        self._pg = pg

    def start_broadcast(self, flat: torch.Tensor) -> Any:
        """Start sending one flattened bucket to the server's ranks (on another rank:
        receiving it into `flat`); returns the work to wait on (bounded by the group's
        timeout)."""
        if self._pg is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is not connected")
        return dist.broadcast(flat, src=0, group=self._pg, async_op=True)

    def destroy(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # noqa: BLE001 - a broken group is being discarded anyway
                logger.warning("destroying weight-update group %s: %s", self.group_name, e)
