"""Module-level reward functions (picklable) for reward-executor tests."""

import time


def right_if_42(prompt, completion, answer="42", **_):
    return 1.0 if completion.strip() == answer else 0.0


def raises(prompt, completion, **_):
    raise ValueError("verifier exploded on " + completion)


def sleeps(prompt, completion, **_):
    time.sleep(60)
    return 1.0
