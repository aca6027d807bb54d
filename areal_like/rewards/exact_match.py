"""Exact-match verification of a final answer (used by the addition task)."""

from __future__ import annotations

import re
from typing import Any

from areal_like.rewards.inline import inline_reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_final_answer(completion: str) -> str:
    """The part of a completion that states the answer.

    Priority: the last `<answer>...</answer>` block, then the text after the last `####`,
    then the whole completion; surrounding whitespace removed.
    """
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    return completion.strip()


@inline_reward  # a regex over a short completion: microseconds
def exact_match_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the completion's final answer equals `answer` exactly (after stripping)."""
    return 1.0 if extract_final_answer(completion) == str(answer).strip() else 0.0
