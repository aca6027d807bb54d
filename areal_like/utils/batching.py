"""Trajectory batching: concatenate groups into one right-padded batch, age them, save them.

A trajectory (the output of one `arun_episode`) is a TensorDict with batch size [B]; per-token
keys are [B, L, ...] with L differing between trajectories. `concat_padded` right-pads every
key with two or more dims along dim 1 to that key's longest length, then concatenates along
dim 0, so rows of one trajectory stay together and in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from tensordict import NonTensorStack, TensorDict, is_non_tensor

from areal_like.api.trajectory import NO_EXPERT, ROUTED_EXPERTS

Key = tuple[str, ...]

# Padding for keys not listed in `pad_values`: 0 (ids, masks, logprobs, rewards...).
DEFAULT_PAD_VALUES: dict[str, Union[int, float, bool]] = {"versions": -1,
                                                           ROUTED_EXPERTS: NO_EXPERT}


def _name(key: Key) -> str:
    return ".".join(key)


def _leaves(td: TensorDict, prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """(key, value) for every tensor or non-tensor leaf, nested TensorDicts flattened."""
    for name, value in td.items():
        key = (*prefix, name)
        if is_non_tensor(value):
            yield key, value.tolist()
        elif isinstance(value, TensorDict):
            yield from _leaves(value, key)
        else:
            yield key, value


def _check_batch(td: Any, index: int) -> int:
    if not isinstance(td, TensorDict):
        raise TypeError(f"concat_padded: item {index} is a {type(td).__name__}, not a TensorDict")
    if len(td.batch_size) != 1:
        raise ValueError(
            f"concat_padded: item {index} has batch_size {tuple(td.batch_size)}; expected a "
            f"1-D batch size [B] (per-token keys are padded along dim 1)"
        )
    return int(td.batch_size[0])


def concat_padded(
    trajectories: Sequence[TensorDict],
    pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
) -> TensorDict:
    """Concatenate TensorDicts with batch size [B_i] into one with batch size [sum B_i].

    Tensors with >= 2 dims are right-padded along dim 1 to the longest length of that key;
    the pad is `pad_values[leaf name]` (default: `versions` -1, everything else 0). [B] keys
    are concatenated. Non-tensor leaves (e.g. strings) become one list per row. Every item
    must have the same keys, dtypes and trailing shapes; an error names the key and item.
    A single item is returned as it is (nothing to pad).
    """
    if len(trajectories) == 0:
        raise ValueError("concat_padded: got an empty list of trajectories")
    pads = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
    sizes = [_check_batch(td, i) for i, td in enumerate(trajectories)]
    if len(trajectories) == 1:
        return trajectories[0]
    leaves = [dict(_leaves(td)) for td in trajectories]
    keys = list(leaves[0])
    for i, item in enumerate(leaves[1:], start=1):
        if set(item) != set(keys):
            missing = sorted(_name(k) for k in set(keys) - set(item))
            extra = sorted(_name(k) for k in set(item) - set(keys))
            raise KeyError(
                f"concat_padded: item {i} has different keys than item 0: missing {missing}, "
                f"extra {extra}"
            )
    out = TensorDict({}, batch_size=[sum(sizes)])
    for key in keys:
        values = [item[key] for item in leaves]
        if isinstance(values[0], list):
            if not all(isinstance(v, list) for v in values):
                raise TypeError(f"concat_padded: key '{_name(key)}' mixes tensors and non-tensors")
            out.set(key, NonTensorStack(*[x for v in values for x in v]))
            continue
        out.set(key, _concat_tensor_key(_name(key), values, pads.get(key[-1], 0)))
    return out


def _concat_tensor_key(name: str, values: list[Any], pad: Union[int, float, bool]) -> torch.Tensor:
    first = values[0]
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"concat_padded: key '{name}' of item {i} is a {type(v).__name__}")
        if v.dtype != first.dtype or v.dim() != first.dim() or v.shape[2:] != first.shape[2:]:
            raise ValueError(
                f"concat_padded: key '{name}' of item {i} has dtype {v.dtype} shape "
                f"{tuple(v.shape)}, item 0 has dtype {first.dtype} shape {tuple(first.shape)}; "
                f"only dim 0 (batch) and dim 1 (length) may differ"
            )
    if first.dim() < 2:
        return torch.cat(values, dim=0)
    length = max(v.shape[1] for v in values)
    padded = []
    for v in values:
        if v.shape[1] < length:
            fill = v.new_full((v.shape[0], length - v.shape[1], *v.shape[2:]), pad)
            v = torch.cat([v, fill], dim=1)
        padded.append(v)
    return torch.cat(padded, dim=0)


def min_generated_version(trajectory: TensorDict) -> Optional[int]:
    """The oldest policy version among tokens the loss trains on (`loss_mask` set); None when
    no token is trained on (such a trajectory cannot be stale)."""
    mask = trajectory["loss_mask"].bool()
    if not mask.any():
        return None
    return int(trajectory["versions"][mask].min())


def trajectory_to_state(trajectory: TensorDict) -> dict[str, Any]:
    """A plain dict (tensors, lists, tuples) that `torch.load(weights_only=True)` can read."""
    _check_batch(trajectory, 0)
    return {
        "batch_size": int(trajectory.batch_size[0]),
        "leaves": [(key, value) for key, value in _leaves(trajectory)],
    }


def trajectory_from_state(state: Mapping[str, Any]) -> TensorDict:
    """Inverse of `trajectory_to_state`."""
    for field in ("batch_size", "leaves"):
        if field not in state:
            raise KeyError(f"trajectory state is missing '{field}'; got keys {sorted(state)}")
    td = TensorDict({}, batch_size=[state["batch_size"]])
    for key, value in state["leaves"]:
        td.set(tuple(key), NonTensorStack(*value) if isinstance(value, list) else value)
    return td
