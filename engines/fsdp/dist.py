"""Process-group and device set-up for the FSDP2 engine (torchrun or a single process)."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

# Bound on every collective: a peer that died or hangs surfaces as an error, not a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def ensure_process_group(backend: str, device: torch.device) -> bool:
    """Join the torchrun job (RANK/WORLD_SIZE in the environment) or start a one-process group.

    Returns True when this call created the group (the engine then destroys it)."""
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(f"the existing process group uses {dist.get_backend()!r}, but the "
                               f"engine needs {backend!r} (TrainEngineConfig.backend)")
        return False
    kwargs = {"backend": backend, "timeout": COLLECTIVE_TIMEOUT}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(**kwargs)
    else:
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, **kwargs)
    return True


def all_reduce_scalar(value: float, device: torch.device, op: str = "sum") -> float:
    """A float summed (or maxed) over all ranks, in float64."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item())
