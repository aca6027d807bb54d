"""SGLang's `torch_native` attention with one SDPA call per group of equal-length requests.

SGLang's CPU attention backend runs scaled-dot-product attention one request at a time, a
Python loop of gathers and SDPA calls per layer: with a GRPO batch of 256 decoding requests
on a 4-layer model that is 1024 calls per decode step, most of the server's core on a small
model. Requests whose key/value lengths are equal (a prompt's samples decode in lockstep) are
stacked here into one call instead. Grouping only by equal shapes keeps each request's
arithmetic exactly what it was alone (the same kernel on the same shapes, batched along its
outermost dimension, gives every request the same bits): no padding, so batch invariance and
`--enable-deterministic-inference` hold. Cross-attention, encoder lengths and sliding windows
keep SGLang's own loop.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

# 1 in a server's environment: SGLang's per-request loop, to compare (benchmarks)
PER_REQUEST_ENV = "AREAL_LIKE_SGLANG_PER_REQUEST_ATTENTION"


def _groups(*keys: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Request indices by their shape key, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, key in enumerate(zip(*keys, strict=True)):
        groups.setdefault(key, []).append(index)
    return groups


def _keys_values(k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                 pool_rows: torch.Tensor, length: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, kv_heads, length, head_dim] keys and values of G requests' first `length` tokens."""
    slots = req_to_token[pool_rows, :length]
    keys, values = k_cache[slots].movedim(1, 2), v_cache[slots].movedim(1, 2)
    if keys.dtype != dtype:  # SDPA wants one dtype (an fp8 cache with a bf16 query)
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


def grouped_sdpa_decode(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        scaling: Optional[float] = None, enable_gqa: bool = False
                        ) -> torch.Tensor:
    """Decode attention: query/output [requests, heads, head_dim], one token each."""
    for (length,), members in _groups(seq_lens.tolist()).items():
        rows = torch.tensor(members, dtype=torch.long, device=query.device)
        keys, values = _keys_values(k_cache, v_cache, req_to_token, req_pool_indices[rows],
                                    length, query.dtype)
        out = scaled_dot_product_attention(query[rows].unsqueeze(2), keys, values,
                                           enable_gqa=enable_gqa, scale=scaling)
        output[rows] = out.squeeze(2)
    return output


def grouped_sdpa_extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                        scaling: Optional[float] = None, enable_gqa: bool = False,
                        causal: bool = False) -> torch.Tensor:
    """Extend (prefill) attention: query/output [tokens, heads, head_dim], each request's new
    tokens after its cached prefix. As SGLang's loop does, the query is laid out over the whole
    sequence (the prefix's rows unused) so that the causal mask is the plain triangular one."""
    lengths, prefixes = seq_lens.tolist(), extend_prefix_lens.tolist()
    new_tokens = extend_seq_lens.tolist()
    starts = [0]
    for n in new_tokens[:-1]:
        starts.append(starts[-1] + n)
    heads, head_dim = query.shape[1], query.shape[2]
    for (length, prefix, new), members in _groups(lengths, prefixes, new_tokens).items():
        if new == 0:
            continue
        offsets = torch.arange(new, device=query.device)
        token_rows = torch.tensor([starts[i] for i in members], device=query.device)
        token_rows = token_rows[:, None] + offsets[None, :]  # [G, new]
        padded = query.new_zeros((len(members), heads, length, head_dim))
        padded[:, :, prefix:, :] = query[token_rows].movedim(1, 2)
        pool_rows = req_pool_indices[torch.tensor(members, device=query.device)]
        keys, values = _keys_values(k_cache, v_cache, req_to_token, pool_rows, length,
                                    query.dtype)
        out = scaled_dot_product_attention(padded, keys, values, enable_gqa=enable_gqa,
                                           scale=scaling, is_causal=causal)
        output[token_rows] = out[:, :, prefix:, :].movedim(1, 2)
    return output


def _plain(encoder_lens: Any, is_cross_attn: bool, sliding_window_size: Any) -> bool:
    """The cases this module groups; the rest keep SGLang's loop."""
    return (encoder_lens is None and not is_cross_attn
            and (sliding_window_size is None or sliding_window_size <= -1))


def install_grouped_attention(backend: ModuleType) -> None:
    """Hook for `sglang.srt.layers.attention.torch_native_backend`."""
    if os.environ.get(PER_REQUEST_ENV) == "1":
        return
    cls = getattr(backend, "TorchNativeAttnBackend", None)
    if cls is None or not hasattr(cls, "_run_sdpa_forward_decode") \
            or not hasattr(cls, "_run_sdpa_forward_extend"):
        raise AttributeError(f"{backend.__name__} no longer has TorchNativeAttnBackend's "
                             "_run_sdpa_forward_decode/_extend: the grouped-attention shim "
                             "(areal_like_sglang_attention.py) needs updating")
    per_request_decode: Callable[..., torch.Tensor] = cls._run_sdpa_forward_decode
    per_request_extend: Callable[..., torch.Tensor] = cls._run_sdpa_forward_extend

    def decode(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               encoder_lens: Optional[torch.Tensor] = None, scaling: Optional[float] = None,
               enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
               sliding_window_size: Optional[int] = None) -> torch.Tensor:
        if not _plain(encoder_lens, is_cross_attn, sliding_window_size):
            return per_request_decode(self, query, output, k_cache, v_cache, req_to_token,
                                      req_pool_indices, seq_lens, encoder_lens, scaling,
                                      enable_gqa, causal, is_cross_attn, sliding_window_size)
        return grouped_sdpa_decode(query, output, k_cache, v_cache, req_to_token,
                                   req_pool_indices, seq_lens, scaling, enable_gqa)

    def extend(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
               encoder_lens: Optional[torch.Tensor] = None, scaling: Optional[float] = None,
               enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
               sliding_window_size: Optional[int] = None) -> torch.Tensor:
        if not _plain(encoder_lens, is_cross_attn, sliding_window_size):
            return per_request_extend(self, query, output, k_cache, v_cache, req_to_token,
                                      req_pool_indices, seq_lens, extend_prefix_lens,
                                      extend_seq_lens, encoder_lens, scaling, enable_gqa,
                                      causal, is_cross_attn, sliding_window_size)
        return grouped_sdpa_extend(query, output, k_cache, v_cache, req_to_token,
                                   req_pool_indices, seq_lens, extend_prefix_lens,
                                   extend_seq_lens, scaling, enable_gqa, causal)

    cls._run_sdpa_forward_decode = decode
    cls._run_sdpa_forward_extend = extend
