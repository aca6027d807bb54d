"""Verifiers. A reward is a plain function `(prompt, completion, **data) -> float`.

`data` is the dataset item (e.g. its `answer`); accept `**kwargs` for the keys you do not use.
Return a finite real number; raising, hanging or returning anything else (a bool, a string,
None, inf) makes the sample *failed* — excluded from training and counted, never a 0.0
(see `areal_like.rewards.reward_executor`). Imports are lazy: reward worker processes import this
package and should not pay for every verifier.
"""

from __future__ import annotations

from typing import Any

from areal_like.lazy import LazyExports

_LAZY = LazyExports(__name__, {
    "exact_match_reward": "areal_like.rewards.exact_match",
    "extract_final_answer": "areal_like.rewards.exact_match",
    "inline_reward": "areal_like.rewards.inline",
    "math_verify_reward": "areal_like.rewards.math_equivalence",
    "reasoning_gym_reward": "areal_like.rewards.reasoning_gym_verifier",
})

__all__ = sorted(_LAZY.names)


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.dir()
