"""Verifiers. A reward is a plain function `(prompt, completion, **data) -> float`.

`data` is the dataset item (e.g. its `answer`); unknown keys are ignored.
"""

from areal_like.rewards.exact_match import exact_match_reward, extract_final_answer
from areal_like.rewards.math_verify_reward import math_verify_reward
from areal_like.rewards.reasoning_gym_reward import reasoning_gym_reward

__all__ = [
    "exact_match_reward",
    "extract_final_answer",
    "math_verify_reward",
    "reasoning_gym_reward",
]
