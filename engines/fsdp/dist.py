"""Process-group and device set-up for the FSDP2 engine (torchrun or a single process)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from areal_like.utils.distributed import (  # noqa: F401 (the engine's set-up, re-exported)
    COLLECTIVE_TIMEOUT,
    ensure_process_group,
    resolve_device_and_backend,
)


def all_reduce_scalar(value: float, device: torch.device, op: str = "sum",
                      group: Optional[dist.ProcessGroup] = None) -> float:
    """A float summed (or maxed) over all ranks (of `group`), in float64."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return float(t.item())
