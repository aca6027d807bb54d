"""Attention for packed 1-D micro-batches: sequences never attend across their boundaries.

On CPU (and on GPU without flash-attn) the engine loads models with
`attn_implementation=PACKED_SDPA` (registered here with `transformers.AttentionInterface`):
it cuts q/k/v at the `cu_seq_lens_q` boundaries the engine passes to the model and runs
causal SDPA per sequence. That is exact and, measured on this machine, ~4x faster than the
dense T x T block-diagonal mask transformers builds from `position_ids`. The name is not in
transformers' mask registry, so no dense mask is built at all.

Many short sequences (a GRPO batch: 128 answers of ~20 tokens) would make as many SDPA calls
per layer, and as many slices whose backward each writes a gradient as large as the whole
row. Sequences of similar lengths are therefore gathered into buckets, each one batched SDPA
call on rows right-padded to the bucket's longest (causal: a real token never sees a pad), and
the real positions scattered back (`benchmarks/packed_attention.py`, docs/benchmarks.md: 3x
less attention time on the main job's batches). With flash-attn installed on
CUDA the engine uses `flash_attention_2`, which reads the same `cu_seq_lens_*` kwargs (varlen).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_SDPA = "areal_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    tree_buckets: Optional[BucketPlan] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D], causal within each segment, or
    over a prefix tree's rows (`tree_buckets`: engines/fsdp/shared_prefix.py).

    Without either (e.g. a plain `model(...)` or `generate` call) it is ordinary SDPA."""
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    if tree_buckets is not None:
        return bucketed_sdpa(query, key, value, tree_buckets, scaling, p, gqa), None
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    plan = bucket_plan(cu_seq_lens_q)
    if plan is None:  # few sequences, or no two alike in length: one call each
        bounds = cu_seq_lens_q.tolist()
        outs = [
            F.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=p, is_causal=True,
                scale=scaling, enable_gqa=gqa,
            )
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
            if e > s
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous(), None
    return bucketed_sdpa(query, key, value, plan, scaling, p, gqa), None


@dataclass(frozen=True)
class Bucket:
    n_rows: int
    length: int  # rows are right-padded to it
    gather: torch.Tensor  # [n_rows * length] packed positions; the padding slot for pads
    # [n_rows, 1, length, length] the keys each query row sees (a prefix tree); None: causal
    mask: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    restore: torch.Tensor  # [T]: each packed position's place in the buckets' padded rows


BUCKET_LENGTH_RATIO = 1.25  # a bucket's longest row at most this x (or + 8 tokens) its shortest
_last_plan: tuple[Optional[torch.Tensor], Optional[BucketPlan]] = (None, None)


def bucketed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  plan: BucketPlan, scaling: Optional[float], dropout: float,
                  gqa: bool) -> torch.Tensor:
    """One SDPA call per bucket of right-padded rows: q [1, H, T, D], k/v [1, Hkv, T, D] ->
    [1, T, H, D] in packed order."""
    # one padding slot at the end of the row: the pads of every bucket read it
    q, k, v = (F.pad(x[0], (0, 0, 0, 1)) for x in (query, key, value))
    pieces = []
    for bucket in plan.buckets:
        rows, length = bucket.n_rows, bucket.length
        qb, kb, vb = (x.index_select(1, bucket.gather).unflatten(1, (rows, length)).transpose(0, 1)
                      for x in (q, k, v))
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bucket.mask, dropout_p=dropout,
                                            is_causal=bucket.mask is None, scale=scaling,
                                            enable_gqa=gqa)
        pieces.append(ob.transpose(0, 1).flatten(1, 2))  # [H, rows * length, D]
    out = torch.cat(pieces, dim=1).index_select(1, plan.restore)  # [H, T, D], packed order
    return out.transpose(0, 1)[None].contiguous()


def similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Indices of the non-empty `lengths` in groups whose longest is at most
    BUCKET_LENGTH_RATIO x (or + 8) their shortest, shortest groups first."""
    groups: list[list[int]] = []
    shortest = 0
    for i in sorted((i for i, n in enumerate(lengths) if n > 0), key=lengths.__getitem__):
        if not groups or lengths[i] > max(shortest * BUCKET_LENGTH_RATIO, shortest + 8):
            groups.append([])
            shortest = lengths[i]
        groups[-1].append(i)
    return groups


def bucket_plan(cu_seq_lens: torch.Tensor) -> Optional[BucketPlan]:
    """Buckets of similar lengths, or None where they would not halve the SDPA calls. The
    same boundaries reach every layer of a forward: the plan of the last ones is kept."""
    global _last_plan
    if _last_plan[0] is cu_seq_lens:
        return _last_plan[1]
    bounds = cu_seq_lens.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    groups = similar_lengths(lengths)
    plan = None
    if len(groups) * 2 <= len(lengths):
        device, total = cu_seq_lens.device, bounds[-1]
        starts = cu_seq_lens[:-1].to(torch.long)
        sizes = (cu_seq_lens[1:] - cu_seq_lens[:-1]).to(torch.long)
        buckets, restore, placed = [], torch.empty(total, dtype=torch.long, device=device), 0
        for group in groups:
            index = torch.tensor(group, device=device)
            length = max(lengths[i] for i in group)
            offsets = torch.arange(length, device=device)
            real = offsets < sizes[index][:, None]
            gather = torch.where(real, starts[index][:, None] + offsets, total).flatten()
            keep = real.flatten().nonzero().squeeze(1)
            restore[gather.index_select(0, keep)] = keep + placed
            placed += gather.numel()
            buckets.append(Bucket(len(group), length, gather))
        plan = BucketPlan(tuple(buckets), restore)
    _last_plan = (cu_seq_lens, plan)
    return plan


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)


def choose_attn_implementation(device: torch.device) -> str:
    """flash_attention_2 (varlen) on CUDA when flash-attn is installed, else packed SDPA."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return PACKED_SDPA


def packed_model_kwargs(cu_seqlens: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments that tell either implementation where the sequences start and end."""
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len,
            "max_length_k": max_len}
