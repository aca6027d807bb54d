"""Module-level reward functions (picklable) for reward-executor tests."""

import time


def right_if_42(prompt, completion, answer="42", **_):
    return 1.0 if completion.strip() == answer else 0.0


def raises(prompt, completion, **_):
    raise ValueError("verifier exploded on " + completion)


def sleeps(prompt, completion, **_):
    time.sleep(60)
    return 1.0


def starts_with_any(prompt, completion, allowed="", **_):
    """1 when the completion's first character is one of `allowed` (pass@k tests)."""
    return 1.0 if completion[:1] and completion[0] in allowed else 0.0
