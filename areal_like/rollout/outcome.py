"""How an episode ended, as the rollout executor records it."""

from __future__ import annotations

import enum


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
