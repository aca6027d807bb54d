"""Attention for packed 1-D micro-batches: sequences never attend across their boundaries.

On CPU (and on GPU without flash-attn) the engine loads models with
`attn_implementation=PACKED_SDPA` (registered here with `transformers.AttentionInterface`):
it splits q/k/v at the `cu_seq_lens_q` boundaries the engine passes to the model and runs
causal SDPA on each segment. That is exact and, measured on this machine, ~4x faster than the
dense T x T block-diagonal mask transformers builds from `position_ids`. The name is not in
transformers' mask registry, so no dense mask is built at all. With flash-attn installed on
CUDA the engine uses `flash_attention_2`, which reads the same `cu_seq_lens_*` kwargs (varlen).
"""

from __future__ import annotations

import importlib.util
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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D], causal within each segment.

    Without `cu_seq_lens_q` (e.g. a plain `model(...)` or `generate` call) it is ordinary SDPA."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    bounds = cu_seq_lens_q.tolist()
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
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
