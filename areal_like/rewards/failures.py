"""What a failed reward looks like to the rest of the system.

A reward call that raises, times out, crashes its worker or returns something that is not a
finite real number is a *failed sample* (`RewardFailure`): it never becomes a reward value.
Workflows let it propagate (or collect several into `GroupRewardFailure`); the rollout
executor excludes the sample or its group from training and counts it. Too many failures of
one function stop the run (`RewardBudgetExceeded`); a function that cannot work at all is
reported before the first step (`RewardFunctionError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, TypeVar

if TYPE_CHECKING:
    from tensordict import TensorDict

T = TypeVar("T")

FAILURE_KINDS = ("raised", "timeout", "invalid", "crashed")


class RewardFailure(Exception):
    """One reward call failed. `kind`: raised | timeout | invalid | crashed."""

    def __init__(self, fn_name: str, kind: str, detail: str, traceback_text: str = "") -> None:
        super().__init__(f"reward function {fn_name} {_VERBS[kind]}: {detail}")
        self.fn_name = fn_name
        self.kind = kind
        self.detail = detail
        self.traceback_text = traceback_text


_VERBS = {"raised": "raised", "timeout": "timed out", "invalid": "returned an invalid reward",
          "crashed": "crashed its worker process"}


class GroupRewardFailure(Exception):
    """Some samples of one episode's group failed their reward.

    `survivors` holds the rows whose rewards succeeded (None when there are none, or when the
    workflow's baseline itself failed); the executor trains on them only when the estimator
    uses no group statistics, otherwise the whole group is excluded."""

    def __init__(self, failures: list[RewardFailure], survivors: Optional[TensorDict]) -> None:
        first = failures[0]
        super().__init__(f"{len(failures)} reward call(s) of the group failed; first: {first}")
        self.failures = failures
        self.survivors = survivors


class RewardBudgetExceeded(RuntimeError):
    """More reward calls of one function failed than `reward.max_failure_rate` allows."""


class RewardFunctionError(ValueError):
    """A reward function cannot be used as configured (found before the first step)."""


def failures_of(exc: BaseException) -> Optional[list[RewardFailure]]:
    """The reward failures an episode's exception stands for, or None if it is not one."""
    if isinstance(exc, GroupRewardFailure):
        return exc.failures
    if isinstance(exc, RewardFailure):
        return [exc]
    return None


def reward_results(results: list[T | BaseException]) -> list[T | RewardFailure]:
    """`asyncio.gather(..., return_exceptions=True)` of reward calls: each value or its
    `RewardFailure`; any other exception (a spent budget, a bug) is raised."""
    out: list[T | RewardFailure] = []
    for result in results:
        if isinstance(result, RewardFailure) or not isinstance(result, BaseException):
            out.append(result)
        else:
            raise result
    return out
