"""How the engine lays a loaded model out on the trainer's mesh: tensor parallelism of every
decoder layer's attention and MLP over the mesh's tensor dimension (DTensor
`parallelize_module`, Megatron's column/row split), then FSDP2 over data x sequence, each
decoder layer its own FSDP unit (one all-gather per layer), mixed precision and offload as
configured.

Tensor parallelism: q/k/v and the MLP's gate/up projections are split by output features
(column-wise: each rank computes its own heads and its slice of the intermediate activations
from the whole input), o_proj and down_proj by input features (row-wise: partial outputs summed
by an all-reduce). Everything else (embeddings, norms, the LM or value head) is replicated over
the tensor dimension. The attention module reshapes by its head size, so each rank simply sees
its heads: nothing in the model changes."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from areal_like.api.config import TrainEngineConfig
from engines.fsdp.mesh import TrainerMesh

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (its `_no_split_modules` classes), in order."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no decoder-layer classes "
                         f"(_no_split_modules={sorted(block_names)}); cannot shard per layer")
    return blocks


# a dense decoder layer's projections (Llama / Qwen2 / Mistral names)
TENSOR_PARALLEL_PLAN: dict[str, type[ParallelStyle]] = {
    "self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel, "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def apply_tensor_parallel(model: Any, mesh: TrainerMesh, path: str, section: str) -> None:
    """Split every decoder layer's projections over the mesh's tensor dimension (in place)."""
    for layer in decoder_layers(model):
        missing = [name for name in TENSOR_PARALLEL_PLAN
                   if not isinstance(_submodule(layer, name), torch.nn.Linear)]
        if missing:
            raise ValueError(
                f"{section}.parallel.tensor_parallel_size={mesh.tp_size}: the decoder layers "
                f"of {type(model).__name__} at {path!r} lack the dense projections "
                f"{missing} (as nn.Linear) that tensor parallelism splits here; use 1")
        parallelize_module(layer, mesh.mesh["tp"],
                           {name: style() for name, style in TENSOR_PARALLEL_PLAN.items()})


def _submodule(layer: torch.nn.Module, name: str) -> Any:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def check_memory_options(cfg: TrainEngineConfig, device: torch.device, section: str) -> None:
    """Offloading moves device memory to the host: on a CPU trainer there is nothing to move,
    and a setting that would do nothing is refused rather than ignored."""
    for key in ("cpu_offload", "activation_offload"):
        if getattr(cfg, key) and device.type != "cuda":
            raise ValueError(f"{section}.{key}=true on a {device.type} trainer: its "
                             f"parameters, gradients, optimizer state and activations already "
                             f"live in host memory; unset it (offloading is for GPU trainers)")


def enable_activation_checkpointing(model: Any, cfg: TrainEngineConfig) -> None:
    """transformers' per-layer checkpointing (non-reentrant) of every
    `gradient_checkpointing_every`-th decoder layer, their saved inputs offloaded if set."""
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False},
                                              every_n_layers=cfg.gradient_checkpointing_every,
                                              offload=cfg.activation_offload)


def shard_model(model: Any, mesh: TrainerMesh, cfg: TrainEngineConfig,
                device: torch.device) -> None:
    """FSDP2 in place: every decoder layer, then the root (embeddings, norm, head)."""
    shard_kwargs: dict[str, Any] = {"mesh": mesh.fsdp}
    if cfg.param_dtype != "float32" or cfg.reduce_dtype != "float32":
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    if cfg.cpu_offload:
        shard_kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in decoder_layers(model):
        fully_shard(block, **shard_kwargs)
    fully_shard(model, **shard_kwargs)


def gradient_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of gradients sharded over the mesh (collective). With tensor
    parallelism they live on two meshes (data x sequence for the replicated layers, x tensor
    for the split ones): each mesh's norm is reduced on its own, then combined."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = 0.0
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    return squares ** 0.5


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """The gradients' global L2 norm (before clipping); scaled in place to `max_norm` when
    it is finite and larger (0: no clipping)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = gradient_norm(grads)
    if math.isfinite(norm) and max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm
