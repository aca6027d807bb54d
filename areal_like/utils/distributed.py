"""Process-group and device set-up shared by the engines and the recipes (torchrun or a single
process)."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from areal_like.utils.tcp_store import bound_store

# Bound on every collective (`TrainEngineConfig.collective_timeout`): a peer that died or
# hangs surfaces as an error, not a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)


def resolve_device_and_backend(backend: str) -> tuple[torch.device, str]:
    """`auto`: CUDA + NCCL when a GPU is visible, else CPU + gloo."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("TrainEngineConfig.backend='nccl' but no CUDA device is visible")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), backend
    return torch.device("cpu"), backend


def ensure_process_group(backend: str, device: torch.device,
                         timeout_s: float = COLLECTIVE_TIMEOUT.total_seconds()) -> bool:
    """Join the torchrun job (RANK/WORLD_SIZE in the environment) or start a one-process group
    whose collectives time out after `timeout_s`.

    Returns True when this call created the group (the engine then destroys it)."""
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(f"the existing process group uses {dist.get_backend()!r}, but the "
                               f"engine needs {backend!r} (TrainEngineConfig.backend)")
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent hosts the store
            dist.init_process_group(**kwargs)
        else:  # started by another launcher (Ray): rank 0 hosts it, on MASTER_ADDR only
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                world, is_master=rank == 0, timeout=timeout)
            dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
    else:
        # an in-process store and loopback gloo: a one-process group listens on nothing else
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return True


# The trainer's data-parallel group (its mesh's "dp" dimension; None: the whole world): the
# ranks that hold distinct rows of a batch. Batch-wide statistics (advantage normalisation,
# the KL controller, the top-entropy selection) pool over it, so the ranks of a
# sequence-parallel group, which hold the same rows, count them once.
_data_parallel_group: Any = None


def set_data_parallel_group(group: Any) -> None:
    """Called by the train engine when it builds its device mesh."""
    global _data_parallel_group
    _data_parallel_group = group


def data_parallel_group() -> Any:
    return _data_parallel_group
