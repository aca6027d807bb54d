"""Dynamic sampling (DAPO): drop groups whose rewards are all equal; they carry no signal for
group-relative estimators.

Two entry points: `drop_zero_variance_groups(trajectory) -> bool` is a should-accept
predicate for the rollout executor (applied to the trajectory of one prompt, i.e. one group),
and `filter_zero_variance_groups(batch, group_index)` filters an assembled batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig


def sequence_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """[B] outcome rewards unchanged; dense [B, L] rewards summed per sequence."""
    return rewards if rewards.dim() == 1 else rewards.sum(dim=-1)


def drop_zero_variance_groups(trajectory: TensorDict) -> bool:
    """Should-accept predicate: True to keep the trajectory, False when all its sequences
    have the same total reward (a single sequence counts as zero variance)."""
    if "rewards" not in trajectory.keys():
        raise KeyError("drop_zero_variance_groups: trajectory has no 'rewards' key; present: "
                       f"{sorted(trajectory.keys())}")
    r = sequence_rewards(trajectory["rewards"])
    return bool(r.numel() > 1 and (r != r.reshape(-1)[0]).any())


def dynamic_sampling_filter(config: AlgorithmConfig) -> Optional[Callable[[TensorDict], bool]]:
    """The executor's should-accept predicate for `config` (None when dynamic sampling is off)."""
    return drop_zero_variance_groups if config.dynamic_sampling else None


def filter_zero_variance_groups(batch: TensorDict, group_index: torch.Tensor,
                                ) -> tuple[TensorDict, torch.Tensor, dict[str, int]]:
    """Keep the rows of groups whose rewards vary. Returns (batch, kept group_index, counts).

    When every group is flat the batch is returned whole (its advantages are all 0 anyway),
    so a training step never sees an empty batch."""
    r = sequence_rewards(batch["rewards"]).to(torch.float64)
    gi = group_index.long().to(r.device)
    n_groups = int(gi.max()) + 1 if gi.numel() else 0
    inf = torch.full((n_groups,), float("inf"), dtype=torch.float64, device=r.device)
    g_max = (-inf).scatter_reduce(0, gi, r, "amax")
    g_min = inf.scatter_reduce(0, gi, r, "amin")
    varied = g_max > g_min
    present = torch.bincount(gi, minlength=n_groups) > 0
    n_present, n_kept = int(present.sum()), int((varied & present).sum())
    counts = {"n_groups_kept": n_kept, "n_groups_dropped": n_present - n_kept}
    keep = varied[gi]
    if not keep.any():
        return batch, gi, counts
    return batch[keep], torch.unique(gi[keep], return_inverse=True)[1], counts
