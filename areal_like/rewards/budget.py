"""The reward error budget: how many failed calls a reward function may have before the run
stops, measured per function over its most recent calls."""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from typing import Optional

from areal_like.rewards.failures import RewardBudgetExceeded, RewardFailure


class FailureBudget:
    """Trips when more than floor(max_rate * window) of a function's last `window` calls
    failed (early in a run, of all its calls so far: a function that always fails stops the
    run after a handful of calls, not after `window`). Once tripped it stays tripped."""

    def __init__(self, max_rate: float, window: int) -> None:
        self.max_rate = max_rate
        self.window = window
        self.allowed = math.floor(max_rate * window + 1e-9)  # 0.29 * 100 is 28.999...: 29
        self._recent: dict[str, deque[bool]] = {}
        self._first: dict[str, RewardFailure] = {}
        self._kinds: dict[str, Counter[str]] = {}
        self._tripped: dict[str, RewardBudgetExceeded] = {}
        self._lock = threading.Lock()

    def record(self, name: str, failure: Optional[RewardFailure]) -> None:
        """Count one call of `name`; raise RewardBudgetExceeded when the budget is spent."""
        with self._lock:
            if name in self._tripped:
                raise self._tripped[name]
            recent = self._recent.setdefault(name, deque(maxlen=self.window))
            recent.append(failure is not None)
            if failure is None:
                return
            self._first.setdefault(name, failure)
            self._kinds.setdefault(name, Counter())[failure.kind] += 1
            failed = sum(recent)
            if failed <= self.allowed:
                return
            first = self._first[name]
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(self._kinds[name].items()))
            error = RewardBudgetExceeded(
                f"reward function {name} failed {failed} of its last {len(recent)} calls, more "
                f"than the {self.allowed} that reward.max_failure_rate={self.max_rate} over "
                f"reward.failure_window={self.window} allows (failures so far: {kinds}). "
                f"Failed samples are never trained on as a reward; fix the function, or raise "
                f"the budget if these failures are expected. First failure: {first}"
                # introduced by a line ending in ':' so that the launcher takes the traceback
                # for part of this message, not for the trainer's cause (trainer_error)
                + (f"\nits traceback:\n{first.traceback_text.rstrip()}"
                   if first.traceback_text else "")
            )
            self._tripped[name] = error
            raise error

    def tripped(self) -> Optional[RewardBudgetExceeded]:
        with self._lock:
            return next(iter(self._tripped.values()), None)
