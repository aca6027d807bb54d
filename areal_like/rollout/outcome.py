"""How an episode ended, as the rollout executor records it."""

from __future__ import annotations

import enum
from collections import Counter


class Outcome(enum.Enum):
    """How an episode ended; each feeds the executor counter of its value's name."""

    ACCEPTED = "accepted"
    PARTIAL_ACCEPTED = "partial_accepted"  # a group without its failed-reward samples
    REJECTED_BY_WORKFLOW = "rejected_by_workflow"  # arun_episode returned None
    REJECTED_BY_FILTER = "rejected_by_filter"  # should_accept said no
    FAILED = "failed"  # a workflow error: raised to the caller of wait()
    FATAL = "fatal"  # raised as it is (a reward budget exceeded), counted as failed
    FAILED_REWARD = "failed_reward"  # excluded and counted
    CANCELLED = "cancelled"  # the executor shut down


_TEXT = {Outcome.REJECTED_BY_WORKFLOW: "rejected by the workflow (returned None)",
         Outcome.REJECTED_BY_FILTER: "rejected by should_accept",
         Outcome.FAILED_REWARD: "excluded for a failed reward"}


def shortfall(kinds: list[Outcome], fresh: int) -> str:
    """Why only `fresh` of these outcomes gave a trajectory to train on (the accepted ones
    beyond `fresh` were dropped as stale), e.g. 'rejected by should_accept 2'."""
    counts = Counter(_TEXT.get(kind, kind.value) for kind in kinds)
    counts["dropped as stale"] = counts["accepted"] - fresh
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()) if n and k != "accepted")
