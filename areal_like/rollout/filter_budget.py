"""How many groups in a row a `should_accept` filter may reject before the run stops.

A filter that rejects every group (DAPO's dynamic sampling on a model that never earns a
reward) would otherwise make the trainer wait silently until `wait_timeout`. A filter opts in by
carrying the attributes of `BudgetedFilter` (e.g. `areal_like.algorithms.filters.
ZeroVarianceGroupFilter`); a plain function predicate is not counted. The executor's state
records every judgement (`FilterBudgets.record`) and, once a filter has rejected
`max_rejected_batches x consumer_batch_size` groups with none accepted in between, fails
every wait with `FilterBudgetExceeded` naming the filter, why it rejected, and what to change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

from areal_like.api.errors import RolloutError
from areal_like.rollout.outcome import Outcome


@runtime_checkable
class BudgetedFilter(Protocol):
    """A should-accept predicate that says why it rejects and how many rejections in a row
    (in consumer batches) mean the run cannot go on. It must be picklable (it travels to the
    rollout controller process)."""

    key: str  # the config key that turned it on, named in errors
    max_rejected_batches: int

    def __call__(self, trajectory: Any) -> bool: ...

    def rejection_reason(self, trajectory: Any) -> str:
        """A short label of why `trajectory` (one group) is rejected, counted per label."""
        ...

    def summarize(self, reasons: Mapping[str, int]) -> str:
        """The rejections counted so far, by label, as a phrase with the numbers."""
        ...

    def advice(self, reasons: Mapping[str, int]) -> str:
        """What the user may change when the budget is spent."""
        ...


class FilterBudgetExceeded(RolloutError):
    """A should-accept filter rejected too many groups in a row: the run stops."""


def rejection_reason(should_accept: Any, trajectory: Any) -> Optional[str]:
    """Why `should_accept` rejected `trajectory`, or None when it does not say (a plain
    function predicate)."""
    if isinstance(should_accept, BudgetedFilter):
        return should_accept.rejection_reason(trajectory)
    return None


@dataclass
class _Streak:
    """Rejections in a row by one filter, and why."""

    filter: BudgetedFilter
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)


class FilterBudgets:
    """Counts consecutive rejections per budgeted filter (by key); not thread-safe: the
    executor state calls it under its own lock."""

    def __init__(self, consumer_batch_size: int) -> None:
        self.consumer_batch_size = consumer_batch_size
        self._streaks: dict[str, _Streak] = {}

    def limit(self, flt: BudgetedFilter) -> int:
        return flt.max_rejected_batches * self.consumer_batch_size

    def record(self, should_accept: Any, kind: Outcome,
               reason: Optional[str]) -> Optional[FilterBudgetExceeded]:
        """Count one judged group; the error to stop the run with once the budget is spent.
        Outcomes the filter did not decide (failed, rejected by the workflow) change nothing."""
        if not isinstance(should_accept, BudgetedFilter):
            return None
        if kind is Outcome.ACCEPTED:  # the filter let one through: the streak ends
            self._streaks.pop(should_accept.key, None)
            return None
        if kind is not Outcome.REJECTED_BY_FILTER:
            return None
        streak = self._streaks.setdefault(should_accept.key, _Streak(should_accept))
        streak.rejected += 1
        streak.reasons[reason or "rejected"] += 1
        if streak.rejected < self.limit(should_accept):
            return None
        return FilterBudgetExceeded(
            f"{self._status(streak)}. The run stops, no batch to train on can be made: "
            f"{should_accept.advice(streak.reasons)}.")

    def rejected_in_a_row(self) -> int:
        """The longest current streak (0 when no budgeted filter is rejecting)."""
        return max((s.rejected for s in self._streaks.values()), default=0)

    def describe(self) -> str:
        """The current streaks, for progress lines and timeout errors ('' when none)."""
        return "".join(f" {self._status(s)}." for s in self._streaks.values())

    def _status(self, streak: _Streak) -> str:
        flt = streak.filter
        return (f"{flt.key} rejected {streak.rejected} group(s) in a row, none accepted in "
                f"between (the run stops at max_rejected_batches {flt.max_rejected_batches} x "
                f"consumer_batch_size {self.consumer_batch_size} = {self.limit(flt)}): "
                f"{flt.summarize(streak.reasons)}")
