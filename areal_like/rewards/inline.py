"""Mark a reward function cheap enough to run in the caller's thread.

A reward that is pure Python, takes microseconds and cannot hang (exact match of a short
answer) costs far more in a worker process round trip (pickling, pipes, wake-ups on both
sides) than in itself. `@inline_reward` lets `RewardExecutor` call it directly
(`RewardConfig.run_inline`, on by default). Everything else about a failure stays the same:
raising or returning a non-number is a failed sample, and a call whose CPU time exceeds
`reward.timeout` is a failed sample too (it cannot be stopped, so mark only functions that
cannot hang).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__areal_like_inline_reward__"


def inline_reward(fn: F) -> F:
    """Declare `fn(prompt, completion, **data) -> float` cheap and unable to hang."""
    setattr(fn, _MARK, True)
    return fn


def is_inline(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, _MARK, False))
