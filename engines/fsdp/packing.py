"""Packing padded batches into 1-D micro-batches, and splitting them by a token budget.

A *batch* is a TensorDict with batch_size [B] holding padded [B, L] sequences: `input_ids`,
`attention_mask` (1 on real tokens; padding may be on either side, but the real tokens of a
row must be contiguous) and any other keys. A key whose first two dims are [B, L] is
*per-token*; any other key (first dim B) is *per-sequence*.

A *packed micro-batch* is a TensorDict with batch_size [] holding a subset of the rows:
- every per-token key concatenated over its real tokens -> [T, ...],
- every per-sequence key -> [n_seqs, ...],
- `cu_seqlens` int64 [n_seqs + 1] (0, len_0, len_0 + len_1, ..., T),
- `position_ids` int64 [T], restarting at 0 for every sequence.
Non-tensor entries of the batch are not carried into micro-batches.

Images (vision-language models) are per-image keys, packed by name: `image_grid_thw`
[B, I, 3] holds each row's images' (t, h, w) patch grids, zero rows after its last image, and
`pixel_values` [B, P, D] their patches in order, zeros after the last; packed, they become the
concatenation of the rows' real images [n_images, 3] and patches [n_patches, D], as the model
takes them.

All functions here are pure and single-process; the engine adds the cross-rank agreement.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Optional

import torch
from tensordict import TensorDict

from areal_like.api.trajectory import IMAGE_KEYS

RESERVED_KEYS = ("cu_seqlens", "position_ids")


def sequence_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Number of real tokens per row of a [B, L] mask; checks the tokens are contiguous."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    first = mask.int().argmax(-1)
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)
    holes = (lengths > 0) & (last - first + 1 != lengths)
    if holes.any():
        row = int(holes.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has gaps: real tokens must be contiguous (padding only "
            f"at the start or end), got {attention_mask[row].tolist()}"
        )
    return lengths


def _first_real_column(attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.bool().int().argmax(-1)


def split_keys(batch: TensorDict) -> tuple[list[str], list[str]]:
    """(per-token keys, per-sequence keys) of a padded batch; rejects nested or misshaped keys."""
    for key in ("input_ids", "attention_mask"):
        if key not in batch.keys():
            raise KeyError(f"batch is missing {key!r}; present keys: {sorted(batch.keys())}")
    clash = [k for k in RESERVED_KEYS if k in batch.keys()]
    if clash:
        raise ValueError(f"batch keys {clash} are reserved for the packed layout; rename them")
    b, seq_len = batch["input_ids"].shape
    if tuple(batch["attention_mask"].shape) != (b, seq_len):
        raise ValueError(
            f"'attention_mask' has shape {tuple(batch['attention_mask'].shape)}; expected "
            f"{(b, seq_len)} like 'input_ids'"
        )
    per_token, per_seq = [], []
    for key, value in batch.items():
        if key in IMAGE_KEYS:
            continue
        if isinstance(value, TensorDict):
            raise ValueError(f"batch key {key!r} is a nested TensorDict; flatten it first")
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (b, seq_len):
            per_token.append(key)
        elif value.dim() >= 1 and value.shape[0] == b:
            per_seq.append(key)
        else:
            raise ValueError(f"batch key {key!r} has shape {tuple(value.shape)}; expected [B={b}, "
                             f"L={seq_len}, ...] (per token) or [B={b}, ...] (per sequence)")
    return per_token, per_seq


def pack_sequences(batch: TensorDict, indices: Sequence[int]) -> TensorDict:
    """Pack rows `indices` of a padded batch into one 1-D micro-batch (see module docstring)."""
    per_token, per_seq = split_keys(batch)
    mask = batch["attention_mask"]
    lengths = sequence_lengths(mask)
    idx = torch.as_tensor(list(indices), dtype=torch.long)
    if idx.numel() == 0:
        raise ValueError("pack_sequences needs at least one row index")
    lens = lengths[idx]
    if (lens == 0).any():
        raise ValueError(f"row {int(idx[lens == 0][0])} of the batch has no real tokens")
    cu = torch.zeros(len(idx) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    n_tokens = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(len(idx)), lens)
    position_ids = torch.arange(n_tokens) - cu[:-1][seg]
    rows = idx[seg]
    cols = _first_real_column(mask)[rows] + position_ids
    out: dict[str, torch.Tensor] = {}
    for key in per_token:
        value = batch[key]
        out[key] = value[rows.to(value.device), cols.to(value.device)]
    for key in per_seq:
        out[key] = batch[key][idx.to(batch[key].device)]
    if "image_grid_thw" in batch.keys():
        out.update(_pack_images(batch, idx))
    device = batch["input_ids"].device
    out["cu_seqlens"] = cu.to(device)
    out["position_ids"] = position_ids.to(device)
    return TensorDict(out, batch_size=[])


def _pack_images(batch: TensorDict, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    if "pixel_values" not in batch.keys():
        raise KeyError("batch has 'image_grid_thw' but no 'pixel_values'")
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    if grids.dim() != 3 or grids.shape[-1] != 3 or pixels.dim() != 3:
        raise ValueError(f"'image_grid_thw' must be [B, I, 3] and 'pixel_values' [B, P, D]; got "
                         f"{tuple(grids.shape)} and {tuple(pixels.shape)}")
    kept_grids, kept_pixels = [], []
    for row in idx.tolist():
        patches = grids[row].prod(-1)
        real = patches > 0
        n_images, n_patches = int(real.sum()), int(patches.sum())
        if not bool(real[:n_images].all()) or n_patches > pixels.shape[1]:
            raise ValueError(f"row {row}: 'image_grid_thw' {grids[row].tolist()} does not list its "
                             f"images first, or needs more than the {pixels.shape[1]} patch rows "
                             f"of 'pixel_values'")
        kept_grids.append(grids[row, :n_images])
        kept_pixels.append(pixels[row, :n_patches])
    return {"image_grid_thw": torch.cat(kept_grids), "pixel_values": torch.cat(kept_pixels)}


def unpack_to_padded(per_seq_values: Sequence[torch.Tensor],
                     attention_mask: torch.Tensor) -> torch.Tensor:
    """Place one [len_b, ...] tensor per row (original order) back into [B, L, ...] at the
    row's real-token positions; padding positions are 0."""
    lengths = sequence_lengths(attention_mask)
    b, seq_len = attention_mask.shape
    if len(per_seq_values) != b:
        raise ValueError(f"got {len(per_seq_values)} per-sequence outputs for a batch of {b} rows")
    first = _first_real_column(attention_mask)
    ref = per_seq_values[0]
    out = torch.zeros((b, seq_len, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
    for row, value in enumerate(per_seq_values):
        n = int(lengths[row])
        if value.shape[0] != n:
            raise ValueError(f"output for row {row} has {value.shape[0]} entries; the row has "
                             f"{n} real tokens")
        start = int(first[row])
        out[row, start:start + n] = value
    return out


def ffd_allocate(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices under `capacity` tokens per bin."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sequence {i} has {n} tokens, more than MicroBatchSpec.max_tokens_per_mb="
            f"{capacity}; raise max_tokens_per_mb to at least the longest sequence (a loss "
            f"group's rows count together: see loss_group_units)"
        )
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def loss_group_units(batch: TensorDict) -> list[list[int]]:
    """What a micro-batch split may not cut: the rows sharing a `loss_group_id` (a preference
    pair, whose loss needs both rows), else each row alone."""
    if "loss_group_id" not in batch.keys():
        return [[i] for i in range(batch.shape[0])]
    members: dict[int, list[int]] = {}
    for row, gid in enumerate(batch["loss_group_id"].tolist()):
        members.setdefault(int(gid), []).append(row)
    return list(members.values())


def count_micro_batches(lengths: Sequence[int], capacity: int, min_count: int = 1) -> int:
    """How many micro-batches this rank needs: max(first-fit-decreasing bins, min_count)."""
    return max(len(ffd_allocate(lengths, capacity)), min_count)


def _lpt(lengths: Sequence[float], order: Sequence[int], k: int) -> list[list[int]]:
    """Longest-processing-time: each sequence (longest first) to the currently lightest bin."""
    heap: list[tuple[float, int]] = [(0.0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(order, key=lambda j: (-lengths[j], j)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def partition_into_micro_batches(lengths: Sequence[int], capacity: int,
                                 count: int) -> list[list[int]]:
    """Exactly `count` groups of sequence indices, each within `capacity` tokens, balanced.

    Balanced (LPT) when that fits the budget; otherwise first-fit-decreasing bins are split
    until there are `count`. Groups are empty only when there are fewer sequences than
    `count` (the engine runs a dummy micro-batch for those, to keep ranks in step)."""
    bins = ffd_allocate(lengths, capacity)
    if len(bins) > count:
        raise ValueError(f"{len(lengths)} sequences need {len(bins)} micro-batches of "
                         f"{capacity} tokens, more than the requested {count}")
    balanced = _lpt(lengths, range(len(lengths)), count)
    if all(sum(lengths[i] for i in g) <= capacity for g in balanced):
        return [sorted(g) for g in balanced]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) >= 2]
        if not splittable:
            bins.append([])
            continue
        heaviest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(heaviest)
        bins.extend(_lpt(lengths, heaviest, 2))
    return [sorted(g) for g in bins]


def attention_width(model_config: dict) -> float:
    """W such that a decoder layer's work on a sequence of L tokens is proportional to
    L * (1 + L / W): per token, the projections and MLP cost 2 (4 h^2 + 3 h I) flops and causal
    attention over L positions 2 L h (h = hidden size, I = the MLP's width)."""
    text = {**model_config, **(model_config.get("text_config") or {})}
    hidden = int(text.get("hidden_size") or 0)
    if hidden <= 0:  # a config that names its width otherwise: balance by tokens
        return 0.0
    return 4.0 * hidden + 3.0 * int(text.get("intermediate_size") or 4 * hidden)


def sequence_costs(lengths: Sequence[int], width: float = 0.0) -> list[float]:
    """Each row's training work: its tokens, plus (with an `attention_width`) its attention,
    which grows with the square of its length; what `dp_shard_indices` equalises."""
    return [n * (1.0 + n / width) if width > 0 else float(n) for n in lengths]


def dp_shard_indices(lengths: Sequence[float], world_size: int, group_size: int = 1,
                     group_ids: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Split rows among `world_size` ranks with balanced loads (`lengths`: token counts, or
    any per-row cost such as `sequence_costs`), keeping each group on one rank: the rows that
    share a `group_ids` value when given (groups of any size, e.g. an agent's turns or a group
    without its failed samples), else consecutive runs of `group_size` rows (e.g. the samples
    of one prompt). Greedy: each group, heaviest first, to the lightest rank (LPT)."""
    if group_ids is not None:
        if len(group_ids) != len(lengths):
            raise ValueError(f"{len(group_ids)} group ids for {len(lengths)} rows")
        members: dict[int, list[int]] = {}
        for row, gid in enumerate(group_ids):
            members.setdefault(int(gid), []).append(row)
        groups = list(members.values())
    else:
        if len(lengths) % group_size:
            raise ValueError(f"batch of {len(lengths)} rows is not a multiple of "
                             f"group_size={group_size}")
        groups = [list(range(g * group_size, (g + 1) * group_size))
                  for g in range(len(lengths) // group_size)]
    group_lens = [sum(lengths[i] for i in rows) for rows in groups]
    assigned = _lpt(group_lens, range(len(groups)), world_size)
    return [sorted(i for g in gs for i in groups[g]) for gs in assigned]


def shard_rows(batch: TensorDict, world_size: int, group_size: int = 1,
               width: float = 0.0) -> list[list[int]]:
    """Each rank's rows of a full batch (see `dp_shard_indices`; a `group_id` key, when the
    batch has one, defines the groups), balanced by tokens or, with an `attention_width`, by
    compute (`sequence_costs`). Without `group_id`, a `loss_group_id` keeps its rows together."""
    costs = sequence_costs(sequence_lengths(batch["attention_mask"]).tolist(), width)
    key = next((k for k in ("group_id", "loss_group_id") if k in batch.keys()), None)
    group_ids = batch[key].tolist() if key else None
    return dp_shard_indices(costs, world_size, group_size, group_ids)


def shard_batch(batch: TensorDict, rank: int, world_size: int, group_size: int = 1,
                width: float = 0.0) -> TensorDict:
    """This data-parallel rank's rows of a full batch (`shard_rows`), for callers that hold
    the whole batch on every rank; `FSDPEngine` expects the local shard."""
    rows = shard_rows(batch, world_size, group_size, width)[rank]
    return batch[torch.as_tensor(rows, dtype=torch.long)]
