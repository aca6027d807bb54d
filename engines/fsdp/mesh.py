"""The trainer's one device mesh: data x sequence x tensor dimensions (torchtitan-style DTensor
mesh). FSDP2 shards the weights over data x sequence (flattened: Ulysses ranks hold the same
weights and see different tokens), tensor parallelism splits layers over the tensor dimension.
Rank order is `areal_like.api.parallel_config`'s (tensor innermost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_like.api.parallel_config import ParallelConfig
from engines.fsdp.moe import moe_shape
from engines.fsdp.vision import is_vision_language

MESH_DIMS = ("dp", "sp", "tp")


@dataclass(frozen=True)
class TrainerMesh:
    """Coordinates and process groups of this rank on the trainer's mesh."""

    mesh: DeviceMesh  # ("dp", "sp", "tp")
    fsdp: DeviceMesh  # dp x sp flattened: what FSDP2 shards over
    dp_size: int
    dp_rank: int
    sp_size: int
    sp_rank: int
    tp_size: int
    tp_rank: int

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        """Sums of per-row quantities (weights, losses, token counts) over distinct data."""
        return self.mesh["dp"].get_group()

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.mesh["sp"].get_group()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

    @property
    def leads_its_rows(self) -> bool:
        """The one rank of its data-parallel group that records per-row statistics (the
        others see the same rows: their records would be duplicates)."""
        return self.sp_rank == 0 and self.tp_rank == 0


def check_same_rows(mesh: TrainerMesh, lengths: list[int]) -> None:
    """Collective over each sequence- and tensor-parallel group: its ranks split one forward,
    so they must hold the same rows (a clear error here, not exchanges of mismatched sizes)."""
    for size, group, what in ((mesh.sp_size, mesh.sp_group, "sequence"),
                              (mesh.tp_size, mesh.tp_group, "tensor")):
        if size == 1:
            continue
        mine = [len(lengths), sum(lengths)]
        seen = torch.tensor(mine + [-n for n in mine], dtype=torch.float64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        if seen[0] != -seen[2] or seen[1] != -seen[3]:
            raise ValueError(
                f"the ranks of a {what}-parallel group were given different batches (this "
                f"rank: {mine[0]} rows, {mine[1]} tokens): they split one forward and must "
                f"hold the same rows; pass each data-parallel rank's shard, "
                f"shard_batch(batch, engine.data_parallel_rank, engine.data_parallel_size)")


def build_trainer_mesh(config: ParallelConfig, device_type: str, section: str) -> TrainerMesh:
    """The mesh over the whole process group (clear errors naming `section`.parallel keys)."""
    world = dist.get_world_size()
    dp = config.data_parallel_size(world, section)
    sp, tp = config.sequence_parallel_size, config.tensor_parallel_size
    mesh = init_device_mesh(device_type, (dp, sp, tp), mesh_dim_names=MESH_DIMS)
    fsdp = mesh["dp", "sp"]._flatten("dp_sp")  # (torchtitan flattens its dp_shard x cp alike)
    rank = dist.get_rank()
    coords = (mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank(),
              mesh["tp"].get_local_rank())
    assert coords[0] == config.data_parallel_rank(rank), (coords, rank)
    return TrainerMesh(mesh, fsdp, dp, coords[0], sp, coords[1], tp, coords[2])


def _text_config(model_config: Any) -> Any:
    """An HF config's language model's (a VLM's text config)."""
    return (model_config.get_text_config() if hasattr(model_config, "get_text_config")
            else model_config)


def attention_heads(model_config: Any) -> tuple[int, int]:
    """(query heads, key/value heads) of an HF config (its text config for a VLM)."""
    text = _text_config(model_config)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def check_heads_divide(config: ParallelConfig, heads: int, kv_heads: int, section: str) -> None:
    """Attention heads are what Ulysses and tensor parallelism split: each rank must hold
    whole query heads; tensor parallelism also splits the key/value heads (Ulysses repeats
    them where there are fewer than its ranks, as the model's grouped-query attention does)."""
    sp, tp = config.sequence_parallel_size, config.tensor_parallel_size
    if heads <= 0:
        raise ValueError(f"{section}.parallel: the model's config names no "
                         f"num_attention_heads, which sequence and tensor parallelism split")
    if heads % (sp * tp):
        keys = " x ".join(f"{section}.parallel.{k}={v}" for k, v in
                          (("sequence_parallel_size", sp), ("tensor_parallel_size", tp)) if v > 1)
        raise ValueError(f"{keys} does not divide the model's num_attention_heads={heads}: "
                         f"each rank must hold whole attention heads")
    if kv_heads % tp:
        raise ValueError(f"{section}.parallel.tensor_parallel_size={tp} does not divide the "
                         f"model's num_key_value_heads={kv_heads}: the key/value projections "
                         f"are split by heads too")


def check_model_fits_mesh(config: ParallelConfig, model_config: Any, path: str,
                          section: str, lora_rank: int = 0) -> None:
    """What the model at `path` must allow for the configured layout (clear errors at start,
    naming `section`.parallel keys)."""
    sp, tp = config.sequence_parallel_size, config.tensor_parallel_size
    if sp == tp == 1:
        return
    if tp > 1 and lora_rank > 0:
        raise ValueError(f"{section}.parallel.tensor_parallel_size={tp} with "
                         f"{section}.lora.rank={lora_rank}: LoRA's adapters are not split with "
                         f"the projections they wrap here; use one of them (Ulysses, "
                         f"sequence_parallel_size, works with LoRA)")
    check_heads_divide(config, *attention_heads(model_config), section)
    key, size = (("sequence_parallel_size", sp) if sp > 1 else ("tensor_parallel_size", tp))
    split = f"{section}.parallel.{key}={size}"
    if is_vision_language(model_config):  # Ulysses needs a forward per token outside
        raise ValueError(f"{split} with the vision-language model at {path!r}: its vision "
                         f"tower and image positions are not split here; use 1")
    if moe_shape(model_config) is not None:  # ... tensor parallelism dense decoder layers
        raise ValueError(f"{split} with the mixture of experts at {path!r}: its routers "
                         f"(records, load-balancing loss) and fused experts are not split "
                         f"here; use 1")
    width = int(getattr(_text_config(model_config), "intermediate_size", 0) or 0)
    if tp > 1 and width % tp:
        raise ValueError(f"{section}.parallel.tensor_parallel_size={tp} does not divide the "
                         f"model's intermediate_size={width}: the MLP is split by its width")
