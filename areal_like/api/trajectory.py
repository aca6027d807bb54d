"""Validation of trajectories produced by workflows, with errors that name the bad key."""

from __future__ import annotations

import torch
from tensordict import TensorDict

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "versions")
REQUIRED_KEYS = TOKEN_KEYS + ("rewards",)
# the behaviour policy's log-probs: checked when present; an algorithm that needs them (off-
# policy corrections: decoupled PPO, or PPO without recomputed old log-probs) says so itself
BEHAVIOUR_LOGPROBS = "logprobs"
# a vision-language model's images, per row (see engines/fsdp/packing.py for the layout)
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
# a mixture of experts' routing as the inference server chose it, per token
# [B, L, n_moe_layers * top_k] int16 expert ids, layer by layer (NO_EXPERT where the server
# recorded none): what router replay (R3, actor.moe.router_replay) routes the trainer by
ROUTED_EXPERTS = "routed_experts"
NO_EXPERT = -1


def model_inputs(batch: TensorDict) -> dict[str, torch.Tensor]:
    """What a trainer's forward reads besides the loss's keys: the tokens, their mask, the
    row's images and the server's expert routing where the batch has them. Actors that build
    a new batch for the engine keep these."""
    keys = ("input_ids", "attention_mask",
            *[k for k in (*IMAGE_KEYS, ROUTED_EXPERTS) if k in batch.keys()])
    return {key: batch[key] for key in keys}


class TrajectoryError(ValueError):
    """A trajectory does not satisfy the contract; the message names the key at fault."""


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def validate_trajectory(td: TensorDict) -> TensorDict:
    """Check `td` against the trajectory contract and return it unchanged.

    Contract: batch size [B]; `input_ids`, `attention_mask`, `loss_mask`, `versions` (and
    `logprobs`, where given) all [B, L] with B, L >= 1 and at least one token per row; ids
    and versions integer; logprobs floating and finite; `rewards` floating [B] (sequence
    reward) or [B, L] (dense per-token reward), finite; loss only on attended tokens; every
    trained token carries a version >= 0.
    """
    if not isinstance(td, TensorDict):
        raise TrajectoryError(f"trajectory must be a TensorDict, got {type(td).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in td]
    if missing:
        raise TrajectoryError(
            f"trajectory is missing key(s) {missing}; required: {list(REQUIRED_KEYS)}, "
            f"present: {sorted(td.keys())}"
        )
    ids = td["input_ids"]
    if ids.dim() != 2:
        raise TrajectoryError(f"'input_ids' has {_describe(ids)}; expected 2-D [B, L]")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise TrajectoryError(f"trajectory is empty ('input_ids' has {_describe(ids)}); a "
                              "workflow with nothing to train on returns None instead")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TrajectoryError(f"'input_ids' has {_describe(ids)}; expected an integer dtype")
    if len(td.batch_size) < 1 or td.batch_size[0] != ids.shape[0]:
        raise TrajectoryError(
            f"trajectory batch_size {tuple(td.batch_size)} does not match 'input_ids' "
            f"{_describe(ids)}; expected batch_size [B] with B = {ids.shape[0]}"
        )
    for key in [*TOKEN_KEYS[1:], *[BEHAVIOUR_LOGPROBS] * (BEHAVIOUR_LOGPROBS in td)]:
        t = td[key]
        if tuple(t.shape) != tuple(ids.shape):
            raise TrajectoryError(
                f"'{key}' has {_describe(t)}; expected shape {tuple(ids.shape)} like 'input_ids'"
            )
    if td["versions"].dtype.is_floating_point:
        raise TrajectoryError(f"'versions' has {_describe(td['versions'])}; expected integers")
    logprobs = td.get(BEHAVIOUR_LOGPROBS, None)
    if logprobs is not None and not logprobs.dtype.is_floating_point:
        raise TrajectoryError(f"'logprobs' has {_describe(logprobs)}; expected a float dtype")
    if logprobs is not None and not torch.isfinite(logprobs).all():
        raise TrajectoryError(f"'logprobs' ({_describe(logprobs)}) contains NaN or inf")
    rewards = td["rewards"]
    if not rewards.dtype.is_floating_point:
        raise TrajectoryError(f"'rewards' has {_describe(rewards)}; expected a float dtype")
    if tuple(rewards.shape) not in ((ids.shape[0],), tuple(ids.shape)):
        raise TrajectoryError(
            f"'rewards' has {_describe(rewards)}; expected shape ({ids.shape[0]},) or "
            f"{tuple(ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise TrajectoryError(f"'rewards' ({_describe(rewards)}) contains NaN or inf; a reward "
                              "that is not a finite number is a failed reward, not a value")
    attn = td["attention_mask"].bool()
    loss = td["loss_mask"].bool()
    if (loss & ~attn).any():
        raise TrajectoryError("'loss_mask' is set on tokens where 'attention_mask' is 0")
    if not attn.any(dim=1).all():
        row = int((~attn.any(dim=1)).nonzero()[0])
        raise TrajectoryError(f"row {row} of the trajectory has no token ('attention_mask' is "
                              "all 0)")
    if (td["versions"][loss] < 0).any():
        raise TrajectoryError(
            "'versions' is negative on tokens where 'loss_mask' is set; every trained token "
            "needs the policy version that generated it"
        )
    routed = td.get(ROUTED_EXPERTS, None)
    if routed is not None and (routed.dim() != 3 or tuple(routed.shape[:2]) != tuple(ids.shape)
                               or routed.dtype.is_floating_point or routed.dtype == torch.bool):
        raise TrajectoryError(
            f"'{ROUTED_EXPERTS}' has {_describe(routed)}; expected integer expert ids "
            f"[{ids.shape[0]}, {ids.shape[1]}, n_moe_layers * top_k], per token like "
            f"'input_ids'")
    return td
