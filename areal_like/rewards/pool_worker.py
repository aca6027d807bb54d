"""Functions that run inside reward worker processes; deliberately imports nothing heavy.

Results travel back as plain tuples of strings and floats, never as the user's objects or
exceptions: an exception or a return value that cannot be pickled must not turn into a
different error on the way back.
"""

from __future__ import annotations

import math
import numbers
import traceback
from typing import Any, Callable

from areal_like.rewards.convention import TokenIds, invoke

Outcome = tuple  # ("ok", float) | ("invalid", detail) | ("raised", detail, traceback)


class InvalidReward(ValueError):
    """A reward function returned something that is not a finite real number."""


def coerce_reward(value: Any) -> float:
    """`value` as a float if it is a finite real number; bools, strings, None, tensors,
    NaN and inf are rejected (a `True` or a `"1.0"` is a bug, not a reward)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_ too
        raise InvalidReward(f"{value!r} is a bool; return a float (e.g. 1.0 / 0.0)")
    if not isinstance(value, numbers.Real):
        raise InvalidReward(f"{value!r} is a {type(value).__name__}, not a real number")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidReward(f"{value!r} is not finite")
    return result


def call_reward(fn: Callable[..., Any], prompt: str, completion: str,
                data: dict[str, Any], ids: TokenIds = None) -> Outcome:
    try:
        value = invoke(fn, prompt, completion, data, ids)
    except Exception as e:
        return ("raised", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        return ("ok", coerce_reward(value))
    except InvalidReward as e:
        return ("invalid", str(e))


def ready(fn: Callable[..., Any] | None = None) -> bool:
    """Warm-up task: receiving `fn` proves this worker can import (unpickle) it."""
    return True
