"""Math answers checked for equivalence by HF `math-verify` (e.g. 1/2 == 0.5 == \\frac{1}{2})."""

from __future__ import annotations

import threading
from typing import Any

from math_verify import parse, verify

from areal_like.rewards.exact_match import extract_final_answer


def math_verify_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the completion's final answer is mathematically equal to `answer`.

    The completion's answer is taken from `\\boxed{}` / `<answer>` / `#### x` or the text
    itself. math-verify's own timeouts use signals, which only work in the main thread; in
    other threads they are off and the caller (a process pool with a timeout) bounds the time.
    """
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold = parse(str(answer), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_verify_reward: reference answer {answer!r} could not be parsed")
    text = completion if "\\boxed" in completion else extract_final_answer(completion)
    pred = parse(text.replace(",", ""), parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
