"""Staleness arithmetic and the executor's counters.

With η = `max_head_offpolicyness`, B = `consumer_batch_size` and v the number of policy
versions since the executor admitted its first rollout (a run may start at any version), a new
rollout is admitted only while

    accepted + running < (η + v + 1) · B

where `accepted` counts every trajectory (group) accepted since the start, consumed or not,
minus those later dropped as stale (a dropped one never feeds a batch, so it must not use up
the budget — otherwise dropping could starve the trainer). The trainer consumes B groups per
version, so the groups of batch k (consumed at version ≥ k) are, in admission order, among the
first (k + 1) · B useful ones, each admitted while v ≥ k − η. Out-of-order completion and
servers that change weights mid-request can still age a group, so consumption also drops any
group whose oldest trained token has version < v − η (`is_stale`): no consumed batch holds a
token from a policy more than η versions old. With η = 0 this is synchronous training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


def staleness_bound(eta: int, version: int, consumer_batch_size: int) -> int:
    """How many groups may be accepted + running at `version` (counted from the version of
    the first admission, see `ExecutorState.versions_since_start`)."""
    return (eta + version + 1) * consumer_batch_size


def admission_capacity(
    eta: int, version: int, consumer_batch_size: int, accepted: int, running: int
) -> int:
    """How many more rollouts the staleness bound admits now (may be <= 0)."""
    return staleness_bound(eta, version, consumer_batch_size) - (accepted + running)


def is_stale(min_version: Optional[int], current_version: int, eta: int) -> bool:
    """True if a group whose oldest trained token has `min_version` is too old to train on."""
    return min_version is not None and min_version < current_version - eta


@dataclass
class RolloutCounters:
    """Cumulative counts since the start (restored by `load_state_dict`)."""

    submitted: int = 0
    completed: int = 0  # episodes that finished (accepted, rejected or failed)
    accepted: int = 0
    rejected_by_workflow: int = 0  # arun_episode returned None
    rejected_by_filter: int = 0  # should_accept returned False
    failed: int = 0  # the workflow raised (the error reaches the caller of wait)
    failed_reward: int = 0  # excluded: a reward call of the episode failed (counted, not raised)
    partial_groups: int = 0  # accepted without their failed samples (no group statistics)
    dropped_stale: int = 0
    consumed: int = 0
    cancelled: int = 0
    # the `accepted` term of the admission bound: bounded (async) groups, minus dropped ones
    staleness_accepted: int = 0

    @property
    def rejected(self) -> int:
        return self.rejected_by_workflow + self.rejected_by_filter

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, int]) -> RolloutCounters:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(state) - known)
        if unknown:
            raise KeyError(f"rollout counters state has unknown key(s) {unknown}")
        return cls(**{k: int(v) for k, v in state.items()})
