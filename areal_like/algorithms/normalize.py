"""Advantage normalisation: per group or per batch, mean and/or std, optional leave-one-out,
and across batches with running statistics; plus the clip-filter sample weights.

For the masked-in entries x of a group g (all tokens of all its sequences; for sequence-level
scores one entry per sequence), with n_g entries, mean mu_g and population std sigma_g
(with `unbiased`: sqrt(sum (x - mu_g)^2 / (n_g - 1)), torch.std's default, as LightRFT and
OpenRLHF compute GRPO's group std):

    mean only:       a = x - b
    std only:        a = x / (sigma_g + eps)
    mean and std:    a = (x - b) / (sigma_g + eps)

where the baseline b = mu_g, or with leave-one-out b = the mean of the group's entries that
belong to *other* sequences (the group's own mean when there are none). A group whose
entries are all equal is never scaled by 1/eps: it gives exactly 0 when the mean is removed
and x unchanged otherwise. Statistics are computed in float64; masked-out entries are 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from areal_like.utils.distributed import data_parallel_group


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Optional[object]) -> None:
    """Over `group`, by default the trainer's data-parallel ranks (a sequence-parallel group's
    ranks hold the same rows: pooled over every rank, each row would count several times)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op, group=group if group is not None else data_parallel_group())


def normalize(
    x: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
    *,
    mean: bool = True,
    std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-5,
    all_reduce: bool = False,
    reduce_group: Optional[object] = None,
    unbiased: bool = False,
) -> torch.Tensor:
    """Normalise `x` ([B] scores or [B, L] per-token values) per group (see module doc).

    `group_index` [B] in 0..G-1 (None: the whole batch is one group). `all_reduce` pools the
    statistics across distributed ranks; only for the whole-batch case (groups are expected
    to live on one rank)."""
    squeeze = x.dim() == 1
    xf = x.to(torch.float64).reshape(x.shape[0], -1)
    m = torch.ones_like(xf, dtype=torch.bool) if mask is None else mask.bool().reshape(xf.shape)
    b = xf.shape[0]
    if group_index is None:
        gi = torch.zeros(b, dtype=torch.long, device=xf.device)
    else:
        if all_reduce:
            raise ValueError("all_reduce pools whole-batch statistics; pass group_index=None")
        gi = group_index.long().to(xf.device)
    n_groups = int(gi.max()) + 1 if b else 1
    zero = torch.zeros((), dtype=torch.float64, device=xf.device)
    xm = torch.where(m, xf, zero)

    seq_sum, seq_cnt = xm.sum(1), m.sum(1).to(torch.float64)
    g_sum = torch.zeros(n_groups, dtype=torch.float64, device=xf.device).index_add(0, gi, seq_sum)
    g_cnt = torch.zeros_like(g_sum).index_add(0, gi, seq_cnt)
    big = torch.finfo(torch.float64).max
    g_max = torch.full_like(g_sum, -big).scatter_reduce(
        0, gi, torch.where(m, xf, -big).amax(1), "amax")
    g_min = torch.full_like(g_sum, big).scatter_reduce(
        0, gi, torch.where(m, xf, big).amin(1), "amin")
    if all_reduce:
        _all_reduce(g_sum, dist.ReduceOp.SUM, reduce_group)
        _all_reduce(g_cnt, dist.ReduceOp.SUM, reduce_group)
        _all_reduce(g_max, dist.ReduceOp.MAX, reduce_group)
        _all_reduce(g_min, dist.ReduceOp.MIN, reduce_group)
    g_mean = g_sum / g_cnt.clamp(min=1)
    dev = torch.where(m, xf - g_mean[gi, None], zero)
    g_sq = torch.zeros_like(g_sum).index_add(0, gi, dev.square().sum(1))
    if all_reduce:
        _all_reduce(g_sq, dist.ReduceOp.SUM, reduce_group)
    # a one-entry group is flat, so its n - 1 = 0 never divides
    g_std = (g_sq / (g_cnt - float(unbiased)).clamp(min=1)).sqrt()
    flat = g_max <= g_min  # all entries equal (or no entries)

    out = xf
    if mean:
        if leave_one_out:
            others = g_cnt[gi] - seq_cnt
            loo = (g_sum[gi] - seq_sum) / others.clamp(min=1)
            baseline = torch.where(others > 0, loo, g_mean[gi])
        else:
            baseline = g_mean[gi]
        out = out - baseline[:, None]
    if std:
        scale = torch.where(flat, torch.ones_like(g_std), g_std + eps)
        out = out / scale[gi, None]
    if mean:
        out = torch.where(flat[gi, None], zero, out)
    out = torch.where(m, out, zero)
    return out.reshape(x.shape[0]) if squeeze else out.reshape(x.shape)


class RunningMoments:
    """Mean and variance of every value seen so far, for cross-batch normalisation.

    Each `update` first multiplies the old statistics' weight by `decay` (1.0: exact moments
    of all batches so far; 0.0: only the newest batch), then merges the new batch (Chan et
    al.'s parallel update, float64)."""

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay={decay} must be in [0, 1]")
        self.decay = decay
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 0.0

    @property
    def std(self) -> float:
        return self.var ** 0.5

    def update(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
               all_reduce: bool = False, reduce_group: Optional[object] = None) -> None:
        xf = x.to(torch.float64).reshape(-1)
        m = torch.ones_like(xf, dtype=torch.bool) if mask is None else mask.bool().reshape(-1)
        stats = torch.stack([m.sum().to(torch.float64), torch.where(m, xf, 0.0).sum()])
        if all_reduce:
            _all_reduce(stats, dist.ReduceOp.SUM, reduce_group)
        n, s = float(stats[0]), float(stats[1])
        if n == 0:
            return
        batch_mean = s / n
        sq = torch.where(m, xf - batch_mean, 0.0).square().sum().reshape(1)
        if all_reduce:
            _all_reduce(sq, dist.ReduceOp.SUM, reduce_group)
        old_n, old_mean, old_m2 = self.count * self.decay, self.mean, self.m2 * self.decay
        total = old_n + n
        delta = batch_mean - old_mean
        self.mean = old_mean + delta * n / total
        self.m2 = old_m2 + float(sq) + delta * delta * old_n * n / total
        self.count = total

    def normalize(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *,
                  mean: bool = True, std: bool = True, eps: float = 1e-5) -> torch.Tensor:
        """(x - running mean) / (running std + eps) on masked-in entries (0 elsewhere); a zero
        running variance never scales by 1/eps (see module doc)."""
        xf = x.to(torch.float64)
        m = torch.ones_like(xf, dtype=torch.bool) if mask is None else mask.bool()
        flat = self.var == 0.0
        out = xf - self.mean if mean else xf
        if std and not flat:
            out = out / (self.std + eps)
        if mean and flat:
            out = torch.zeros_like(out)
        return torch.where(m, out, torch.zeros_like(out))


def clip_filter_weights(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    max_weight: float = 3.0,
    flat_weight: float = 1.0,
    all_reduce: bool = False,
    reduce_group: Optional[object] = None,
) -> torch.Tensor:
    """Clip-filter sample weights [B] from per-sequence scores [B] (LightRFT's
    `clip_filter_like_weight_func`).

    With G groups in the batch (pooled over ranks when `all_reduce`) of which G_flat have all
    scores equal: every sample of a flat group gets `flat_weight` (lambda, default 1), every
    other sample min(G / (G - G_flat), max_weight), so the groups that carry signal keep the
    batch's total weight as if the flat ones had been resampled. All groups flat: all ones.
    """
    s = scores.to(torch.float64)
    gi = group_index.long().to(s.device)
    n_groups = int(gi.max()) + 1 if s.numel() else 1
    g_max = torch.full((n_groups,), -float("inf"), dtype=torch.float64, device=s.device)
    g_min = torch.full((n_groups,), float("inf"), dtype=torch.float64, device=s.device)
    g_max = g_max.scatter_reduce(0, gi, s, "amax")
    g_min = g_min.scatter_reduce(0, gi, s, "amin")
    present = torch.bincount(gi, minlength=n_groups) > 0
    flat = g_max <= g_min
    counts = torch.stack([present.sum(), (present & flat).sum()]).to(torch.float64).cpu()
    if all_reduce:
        _all_reduce(counts, dist.ReduceOp.SUM, reduce_group)
    total, n_flat = float(counts[0]), float(counts[1])
    if n_flat == total:
        return torch.ones_like(s)
    w = min(total / (total - n_flat), max_weight)
    return torch.where(flat[gi], torch.full_like(s, float(flat_weight)), torch.full_like(s, w))
