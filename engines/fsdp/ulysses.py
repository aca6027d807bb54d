"""Ulysses sequence parallelism: a packed micro-batch's tokens split over the ranks of a
sequence-parallel group, attention heads exchanged by all-to-all.

Every layer but attention is per-token, so each rank runs it on its own chunk of the packed
row (1/sp of the activations). Attention needs every token: its q/k/v [1, H, T/sp, D] are
exchanged so that each rank holds H/sp heads of the whole row [1, H/sp, T, D], the packed
attention runs there with the micro-batch's own sequence boundaries, and a second all-to-all
brings each rank its tokens' outputs of every head back. Position ids travel with the tokens,
so rotary embeddings see global positions.

The micro-batch is padded to a multiple of sp with pad tokens forming one extra sequence of
their own (they attend only to each other, nothing attends to them, and their outputs are
dropped). The per-token outputs of the chunks are gathered back into the micro-batch's [T, ...]
so `loss_fn(logits, mb)` keeps its contract; every rank of the group computes the same loss on
the same gathered outputs, hence the gather's backward hands each rank the gradient of its own
chunk only (no sum over the group).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engines.fsdp.attention import packed_model_kwargs

ULYSSES_ATTENTION = "areal_ulysses"


@dataclass(frozen=True)
class SequenceShard:
    """One micro-batch's split over the group: this rank's tokens are [rank * local,
    (rank + 1) * local) of the padded row."""

    group: dist.ProcessGroup
    rank: int
    size: int
    inner: str  # the attention implementation that runs on whole sequences
    n_tokens: int  # the micro-batch's real tokens
    local: int  # tokens per rank

    @property
    def padding(self) -> int:
        return self.local * self.size - self.n_tokens


class _AllToAll(torch.autograd.Function):
    """x split into `size` chunks along `scatter_dim`, chunk j sent to rank j; what each rank
    receives concatenated along `gather_dim` in rank order. Backward: the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _GatherSequence(torch.autograd.Function):
    """[local, ...] chunks of the group -> [local * size, ...] on every rank; backward: this
    rank's slice of the gradient (every rank computes the same loss on the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        ctx.shard = shard
        out = x.new_empty((shard.local * shard.size, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=shard.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shard = ctx.shard
        return grad[shard.rank * shard.local:(shard.rank + 1) * shard.local].contiguous(), None


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      sequence_shard: Optional[SequenceShard] = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """q [1, H, T/sp, D], k/v [1, Hkv, T/sp, D] -> [1, T/sp, H, D]: heads exchanged for
    tokens, the inner attention over the whole row (boundaries from `cu_seq_lens_*` in
    `kwargs`), exchanged back."""
    if sequence_shard is None:
        raise RuntimeError("a model loaded for Ulysses sequence parallelism was called without "
                           "its sequence shard: run it through FSDPEngine (forward/train_batch)")
    size, group = sequence_shard.size, sequence_shard.group
    kv_heads = key.shape[1]
    if kv_heads % size:  # fewer key/value heads than ranks: repeat each, as GQA shares them
        repeat = math.lcm(kv_heads, size) // kv_heads
        key, value = (x.repeat_interleave(repeat, dim=1) for x in (key, value))
    q, k, v = (_AllToAll.apply(x, group, 1, 2) for x in (query, key, value))
    inner = ALL_ATTENTION_FUNCTIONS[sequence_shard.inner]
    out, _ = inner(_as_inner(module, sequence_shard.inner), q, k, v, attention_mask,
                   **kwargs)  # [1, T, H/sp, D]
    return _AllToAll.apply(out, group, 1, 2), None


class _InnerView:
    """An attention module as the inner implementation must see it: its config names that
    implementation (transformers' flash-attn wrapper picks its kernel by
    `module.config._attn_implementation`, which names Ulysses on the module itself)."""

    def __init__(self, module: torch.nn.Module, inner: str) -> None:
        self._module = module
        config = copy.copy(getattr(module, "config"))  # noqa: B009 (nn.Module's attribute)
        config._attn_implementation = inner
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


_inner_views: dict[tuple[int, str], _InnerView] = {}


def _as_inner(module: torch.nn.Module, inner: str) -> Any:
    config = getattr(module, "config", None)
    if config is None or getattr(config, "_attn_implementation", inner) == inner:
        return module
    view = _inner_views.get((id(module), inner))
    if view is None or view._module is not module:
        view = _inner_views[(id(module), inner)] = _InnerView(module, inner)
    return view


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)


def shard_inputs(mb: TensorDict, group: dist.ProcessGroup, inner: str,
                 pad_token_id: int) -> tuple[SequenceShard, torch.Tensor, dict[str, Any]]:
    """(the split, this rank's input ids [1, T/sp], the model's other inputs) of packed
    micro-batch `mb` (input_ids, position_ids, cu_seqlens)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, positions, cu = mb["input_ids"], mb["position_ids"], mb["cu_seqlens"]
    n_tokens = ids.shape[0]
    shard = SequenceShard(group, rank, size, inner, n_tokens, -(-n_tokens // size))
    if shard.padding:  # one more sequence, of pad tokens only
        pad = shard.padding
        ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device,
                                                        dtype=positions.dtype)])
        cu = torch.cat([cu, cu.new_tensor([n_tokens + pad])])
    mine = slice(rank * shard.local, (rank + 1) * shard.local)
    inputs = {"position_ids": positions[mine][None], "sequence_shard": shard,
              **packed_model_kwargs(cu)}
    return shard, ids[mine][None], inputs


def gather_outputs(local: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """This rank's per-token outputs [T/sp, ...] -> the micro-batch's [T, ...] (padding
    dropped), on every rank of the group."""
    return _GatherSequence.apply(local, shard)[:shard.n_tokens]
