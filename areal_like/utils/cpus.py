"""Pinning processes to CPU cores: the CPU counterpart of giving the trainer and the inference
servers their own GPUs. Where they share cores, Linux's scheduler interleaves them and the
trainer (the critical path) waits for a core the server holds; pinned, each side has its own.
Children inherit a process's affinity (SGLang's scheduler and detokenizer, reward workers)."""

from __future__ import annotations

import os
from typing import Optional, Sequence


def check_cpus(key: str, cpus: Sequence[int]) -> None:
    """A ValueError naming `key`, the bad ids and the allowed cores unless this process may
    run on every one of `cpus`."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"{key}={list(cpus)}: CPU {missing} not available to this process "
                         f"(allowed: {sorted(allowed)})")


def pin_to_cpus(key: str, cpus: Sequence[int]) -> None:
    """Restrict this process (and what it starts afterwards) to `cpus`; empty: no change.
    (Checked against the machine, not against this process's affinity: a trainer pinned to
    one core may put its rollout controller on another.)"""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in cpus})
    except OSError as e:
        raise ValueError(f"{key}={list(cpus)}: cannot run on these CPUs ({e.strerror}; this "
                         f"machine has {os.cpu_count()})") from None


def split_cores(allowed: set[int], trainer_cores: int) -> Optional[tuple[list[int], list[int]]]:
    """(rollout side, trainer) cores: the trainer takes the last `trainer_cores` of `allowed`,
    servers and rollout controller the rest; None when that leaves the rollout side none."""
    cores = sorted(allowed)
    if len(cores) <= trainer_cores:
        return None
    return cores[:-trainer_cores], cores[-trainer_cores:]
