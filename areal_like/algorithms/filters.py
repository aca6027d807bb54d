"""Dynamic sampling (DAPO): drop groups whose rewards are all equal; they carry no signal for
group-relative estimators.

`top_entropy_mask` selects the highest-entropy tokens of a whole batch (the "80/20" filter).

Two entry points for dynamic sampling: `drop_zero_variance_groups(trajectory) -> bool` is a
should-accept predicate for the rollout executor (applied to the trajectory of one prompt, i.e.
one group), and `filter_zero_variance_groups(batch, group_index)` filters an assembled batch.
`dynamic_sampling_filter(config)` wraps the predicate in a `ZeroVarianceGroupFilter`, which
also says why it rejects and stops the run after `filters.max_rejected_batches` consumer
batches' worth of rejections in a row (see `areal_like.rollout.filter_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.utils.distributed import data_parallel_group

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


class ZeroVarianceGroupFilter:
    """`drop_zero_variance_groups` as a budgeted should-accept filter: it names the label of
    each rejection ('all 0.0': every sample's reward was 0.0) so that a model that never
    earns a reward stops the run with the reason, instead of waiting for a batch that never
    comes. Picklable: it travels to the rollout controller process."""

    key = "algorithm.filters.dynamic_sampling"

    def __init__(self, max_rejected_batches: int = 10) -> None:
        self.max_rejected_batches = max_rejected_batches

    def __call__(self, trajectory: TensorDict) -> bool:
        return drop_zero_variance_groups(trajectory)

    def rejection_reason(self, trajectory: TensorDict) -> str:
        r = sequence_rewards(trajectory["rewards"]).reshape(-1)
        return "of one sample" if r.numel() <= 1 else f"all {float(r[0])}"

    def summarize(self, reasons: Mapping[str, int]) -> str:
        counts = sorted(reasons.items(), key=lambda kv: -kv[1])
        parts = [f"{n} {('group ' if n == 1 else 'groups ') if i == 0 else ''}{why}"
                 for i, (why, n) in enumerate(counts)]
        return "every group's rewards were equal: " + ", ".join(parts)

    def advice(self, reasons: Mapping[str, int]) -> str:
        # all rewards <= 0: nothing was ever right; otherwise it may also be always right
        values = [float(why[4:]) for why in reasons if why.startswith("all ")]
        if values and max(values) <= 0:
            task = "the task may be too hard for the model: warm-start with SFT, use an easier task"
        else:  # some groups were all right: maybe too easy
            task = ("the task may be too hard (or too easy) for the model: warm-start with SFT, "
                    "use an easier (or harder) task")
        return f"{task}, set {self.key}=false, or raise algorithm.filters.max_rejected_batches"

    def __repr__(self) -> str:
        return f"ZeroVarianceGroupFilter(max_rejected_batches={self.max_rejected_batches})"


def dynamic_sampling_filter(config: AlgorithmConfig) -> Optional[ZeroVarianceGroupFilter]:
    """The executor's should-accept filter for `config` (None when dynamic sampling is off)."""
    if not config.filters.dynamic_sampling:
        return None
    return ZeroVarianceGroupFilter(config.filters.max_rejected_batches)


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


def _gather_variable(local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The data-parallel ranks' 1-D tensors concatenated in rank order, and this rank's offset
    in it (a sequence-parallel group's ranks hold the same rows: they count once)."""
    group = data_parallel_group()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([local.numel()], dtype=torch.long), group=group)
    counts = [int(c) for c in sizes]
    padded = torch.zeros(max(counts), dtype=local.dtype)
    padded[: local.numel()] = local.cpu()
    parts = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    whole = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])
    return whole, sum(counts[: dist.get_rank(group)])


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, ratio: float,
                     all_ranks: bool = False) -> torch.Tensor:
    """Bool mask [B, L] of the top ceil(ratio * n) of the n masked-in tokens by `entropy`.

    With `all_ranks` the n tokens are those of every rank's batch (gathered), so the
    selection is the same as on one rank holding the whole batch. Ties break by position."""
    m = mask.bool()
    if ratio >= 1.0:
        return m
    local = entropy.detach().to(torch.float64)[m]
    whole, offset = _gather_variable(local) if all_ranks else (local, 0)
    k = math.ceil(round(ratio * whole.numel(), 9))
    chosen = torch.zeros(whole.numel(), dtype=torch.bool)
    if k > 0:
        chosen[torch.topk(whole.cpu(), k).indices] = True
    out = torch.zeros_like(m)
    out[m] = chosen[offset: offset + local.numel()].to(m.device)
    return out
