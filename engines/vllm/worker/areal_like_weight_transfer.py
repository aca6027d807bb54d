"""Our process-group transport as one of vLLM's weight-transfer engines (vLLM >= 0.32,
`vllm/distributed/weight_transfer/`), registered under `areal_like_process_group` and chosen
with `--weight-transfer-config {"backend": "areal_like_process_group"}`; the fleet client
drives it through vLLM's own endpoints: `/init_weight_transfer_engine` (join the trainer's
group), `/start_weight_update`, one `/update_weights` per bucket, `/finish_weight_update`
(with the version label).

Why our own engine and not vLLM's `nccl`: vLLM's trainer end is vLLM code (its own NCCL
communicator over a `StatelessProcessGroup`), which our trainer, outside vLLM's virtual
environment, does not run; and every engine vLLM ships needs CUDA. Ours joins the group our
trainer forms with torch.distributed (`engines/weight_transport/process_group_trainer.py`;
gloo on CPU, NCCL on GPU), as SGLang's end does. What is vLLM's: the endpoints, the update's
lifecycle (one at a time, refused out of order), and the loading: each bucket goes straight
into the model through vLLM's layerwise reload (a layer is processed once all its tensors
arrived), so no second copy of the weights is held.

A failure never ends vLLM's engine: it is raised to the endpoint (HTTP 500 naming it), the
update is closed (`finalize_layerwise_reload`: a layer that got nothing keeps its old tensors)
so the server can take a full load later, and the group is left (a broadcast that failed
leaves it unusable).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from areal_like_vllm_reload import repack_cpu_experts
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "areal_like_process_group"


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """Where the trainer's group meets: its TCP store, this server's first rank in it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors' HF names, dtypes and shapes, broadcast as one byte buffer
    (their bytes concatenated in this order) from the trainer's rank 0."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"a bucket needs one dtype and one shape per name: "
                             f"{len(self.names)} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes")


def join_group(info: GroupInitInfo, worker_rank: int) -> Any:
    """This worker's end of the trainer's group (rank `rank_offset + worker_rank`)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=float(info.timeout_s))
    store = dist.TCPStore(info.master_address, int(info.master_port), int(info.world_size),
                          is_master=False, timeout=timeout)
    pg, _ = _new_process_group_helper(int(info.world_size), int(info.rank_offset) + worker_rank,
                                      [], Backend(info.backend),
                                      PrefixStore(info.group_name, store),
                                      group_name=GroupName(info.group_name),
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(int(info.world_size))}
    return pg


class ProcessGroupWeightTransfer(WeightTransferEngine[GroupInitInfo, BucketUpdateInfo]):
    init_info_cls = GroupInitInfo
    update_info_cls = BucketUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Optional[Any] = None
        self.group_backend = ""
        self.updating = False

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        self.shutdown()  # a trainer that joins again (restarted) replaces the old group
        self.group = join_group(init_info, self.parallel_config.rank)
        self.group_backend = init_info.backend

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.group is None:
            raise RuntimeError("no weight-update group: /init_weight_transfer_engine first")
        initialize_layerwise_reload(self.model)
        self.updating = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One bucket, loaded as it arrives. A failure closes the update and leaves the group
        before it is raised: vLLM's worker then forgets the update, and the next one starts
        from a join."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException:
            self._close_update()
            self.shutdown()
            raise

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if self.group is None or not self.updating:
            raise RuntimeError("a bucket outside an update: /start_weight_update first")
        kinds = [getattr(torch, d) for d in update_info.dtype_names]
        sizes = [math.prod(s) * torch.empty(0, dtype=k).element_size()
                 for s, k in zip(update_info.shapes, kinds, strict=True)]
        device = self.device if self.group_backend == "nccl" else torch.device("cpu")
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=self.group)
        weights, offset = [], 0
        for name, size, kind, shape in zip(update_info.names, sizes, kinds,
                                           update_info.shapes, strict=True):
            weights.append((name, flat[offset:offset + size].view(kind).view(shape)))
            offset += size
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        self._close_update()
        repack_cpu_experts(self.model)

    def _close_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.updating:
            self.updating = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            dist.destroy_process_group(group)


def register() -> None:
    """Make the engine known to vLLM's factory in this process (the worker imports our
    extension before it builds its engine); once."""
    with contextlib.suppress(ValueError):  # already registered
        WeightTransferEngineFactory.register_engine(BACKEND, __name__,
                                                    ProcessGroupWeightTransfer.__name__)
