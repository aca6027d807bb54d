"""The vLLM server's end of the trainer's weight-update group, mixed into vLLM's worker
(`--worker-extension-cls areal_like_vllm_worker.WeightGroupExtension`; this folder is on the
server's PYTHONPATH) and called through `/collective_rpc` (`engines/vllm/api.py`).

Runs inside the vLLM venv, so it imports only torch. The group is formed as SGLang forms its
end (`engines/weight_transport/process_group_trainer.py` is the trainer's): a TCP store
client at the trainer's `master_address:master_port`, a store prefixed with the group name,
a process group of `world_size` ranks where this worker is `rank_offset + its tensor-
parallel rank`. A bucket arrives as one broadcast of its tensors' bytes, concatenated in
order; after the last one the whole set is loaded by vLLM's in-place `reload_weights` (HF
names; vLLM fuses q/k/v and gate/up itself). Until then the worker holds the received
tensors: a second copy of the weights for the length of one update.

Every method returns '' or the error as text, never raises: an exception in a worker method
ends vLLM's engine (the server then answers HTTP 500 to everything), where a refused load must
leave it serving (the client takes it out of service and reloads it).
"""

from __future__ import annotations

import functools
import math
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def _reported(method: Callable[..., None]) -> Callable[..., str]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> str:
        try:
            method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
            return f"{type(e).__name__}: {e}"
        return ""

    return call


class WeightGroupExtension:
    """Methods added to vLLM's worker (`self.model_runner`, `self.rank` are the worker's)."""

    def _areal_like_groups(self) -> dict[str, Any]:
        groups = getattr(self, "_areal_like_weight_groups", None)
        if groups is None:
            groups = {}
            self._areal_like_weight_groups = groups
        return groups

    @_reported
    def areal_like_load_from_disk(self, path: str) -> None:
        """vLLM's own in-place reload of the HF folder `path`. The folder is checked first:
        vLLM's reload takes the model apart before it reads the files (a missing folder would
        leave a model that kills the worker at its next step, and would be looked up on the
        Hub)."""
        folder = Path(path)
        weights = [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
        if not folder.is_dir() or not weights:
            raise FileNotFoundError(f"{path} is not a model folder with *.safetensors or *.bin "
                                    f"weights on this server's machine")
        self.reload_weights(weights_path=str(folder))  # type: ignore[attr-defined]
        _repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

    @_reported
    def areal_like_join_weight_group(self, master_address: str, master_port: int,
                                     rank_offset: int, world_size: int, group_name: str,
                                     backend: str, timeout_s: float) -> None:
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )

        timeout = timedelta(seconds=float(timeout_s))
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        store = dist.TCPStore(master_address, int(master_port), int(world_size),
                              is_master=False, timeout=timeout)
        pg, _ = _new_process_group_helper(int(world_size), rank, [], Backend(backend),
                                          PrefixStore(group_name, store),
                                          group_name=GroupName(group_name),
                                          backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(int(world_size))}
        self._areal_like_groups()[group_name] = pg
        self._areal_like_pending().clear()

    @_reported
    def areal_like_receive_bucket(self, names: list[str], dtypes: list[str],
                                  shapes: list[list[int]], group_name: str,
                                  last: bool) -> None:
        """Receive one bucket; after the `last` one, load them all with vLLM's in-place
        reload (a bucket holds part of a layer's tensors: vLLM loads a layer once it has them
        all, and its loaders are gone after start-up outside a reload)."""
        pg = self._areal_like_groups().get(group_name)
        if pg is None:
            raise RuntimeError(f"weight-update group {group_name!r} was not joined")
        kinds = [getattr(torch, d) for d in dtypes]
        sizes = [math.prod(s) * torch.empty(0, dtype=k).element_size()
                 for s, k in zip(shapes, kinds, strict=True)]
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        pending = self._areal_like_pending()
        offset = 0
        for name, size, kind, shape in zip(names, sizes, kinds, shapes, strict=True):
            pending.append((name, flat[offset:offset + size].view(kind).view(shape)))
            offset += size
        if last:
            weights, pending[:] = list(pending), []
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            _repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

    def _areal_like_pending(self) -> list[tuple[str, torch.Tensor]]:
        """Buckets of the broadcast in progress (a failed one is dropped by the next join)."""
        pending = getattr(self, "_areal_like_weights", None)
        if pending is None:
            pending = []
            self._areal_like_weights = pending
        return pending

    def areal_like_apply_weight_file(self, path: str, model_digest: bool = False) -> str:
        """The delta transport: apply the weight file `path` (engines/weight_transport/delta/,
        on this server's PYTHONPATH) with vLLM's in-place reload of the whole new state (a
        reload of part of a layer would leave it unloaded); the receipt as JSON."""
        import json

        import areal_like_weight_delta

        def load(changed: list[tuple[str, torch.Tensor]],
                 state: dict[str, torch.Tensor]) -> None:
            self.reload_weights(weights_iterator=iter(list(state.items())))  # type: ignore[attr-defined]
            _repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

        def digest() -> str:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            return areal_like_weight_delta.parameters_digest(model.named_parameters())

        held = getattr(self, "_areal_like_held", None)
        if held is None:
            held = areal_like_weight_delta.HeldWeights()
            self._areal_like_held = held
        def fingerprint() -> str:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            return areal_like_weight_delta.model_fingerprint(model.named_parameters())

        receipt = held.apply_file(path, load, digest if model_digest else None, fingerprint)
        return json.dumps(receipt)

    @_reported
    def areal_like_leave_weight_group(self, group_name: str) -> None:
        pg = self._areal_like_groups().pop(group_name, None)
        if pg is not None:
            dist.destroy_process_group(pg)


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """After an in-place reload, lay a mixture of experts' weights out again for vLLM's CPU
    MoE kernel. vLLM 0.32 prepacks them (`CPUUnquantizedExperts.process_weights_after_loading`)
    at start-up only, and a reload writes the checkpoint's plain [E, 2I, H] / [E, H, I]
    tensors into the prepacked storage: the kernel then reads them in the wrong layout and
    every MoE layer computes garbage without an error. The repacked values go back into the
    parameters' own storage (what the compiled model holds)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build: its kernels read the weights as loaded
        return
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        loaded = {name: getattr(layer, name) for name in ("w13_weight", "w2_weight")}
        experts.process_weights_after_loading(layer)  # registers new, prepacked parameters
        for name, param in loaded.items():
            packed = getattr(layer, name).data
            if packed.shape != param.shape:  # vLLM padded the experts' width
                raise RuntimeError(f"{name}: prepacked {tuple(packed.shape)} != loaded "
                                   f"{tuple(param.shape)}; reloading this MoE is unsupported")
            param.data.copy_(packed)
            layer.register_parameter(name, param)
