"""AdamW and learning-rate schedules (constant / linear / cosine, with linear warm-up)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from areal_like.api.config import OptimizerConfig


def build_optimizer(params: list[torch.nn.Parameter],
                    cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def lr_multiplier(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """step -> factor of `cfg.lr`: warm-up from 1/(warmup+1) to 1 over the first
    `warmup_steps_proportion * total_steps` steps, then constant, or a linear / cosine decay
    that reaches `min_lr_ratio` at `total_steps`."""
    if cfg.lr_scheduler_type != "constant" and total_steps <= 0:
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type!r} needs "
                         f"TrainEngineConfig.total_train_steps > 0, got {total_steps}")
    warmup = int(cfg.warmup_steps_proportion * max(total_steps, 0))
    floor = cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.lr_scheduler_type == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, total_steps))
