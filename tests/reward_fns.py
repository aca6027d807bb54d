"""Module-level reward functions (picklable) for reward-executor tests."""

import os
import time

from areal_like.rewards import inline_reward


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


def sleeps_briefly(prompt, completion, seconds="1.0", **_):
    """Takes `seconds` of wall time, then is right: longer than nothing, well inside a timeout."""
    time.sleep(float(seconds))
    return 1.0


def returns(prompt, completion, value=None, **_):
    """Returns the data item's `value` unchanged (to feed invalid rewards through a worker)."""
    return value


def hangs_on(prompt, completion, hang=False, answer="42", **_):
    """Hangs (until killed) when the item says so; otherwise exact match against `answer`."""
    if hang:
        time.sleep(3600)
    return 1.0 if completion.strip() == answer else 0.0


def raises_on_third(prompt, completion, **_):
    """Raises for completions whose length is divisible by 3 (deterministic in the text)."""
    if len(completion) % 3 == 0:
        raise ValueError(f"cannot score {completion!r}")
    return float(len(completion) % 2)


def exits(prompt, completion, **_):
    """Kills its own worker process."""
    import os

    os._exit(3)


@inline_reward
def inline_pid(prompt, completion, **_):
    """The process it ran in (a real number, so a valid reward)."""
    return float(os.getpid())


@inline_reward
def inline_raises(prompt, completion, **_):
    raise ValueError("inline verifier exploded on " + completion)


@inline_reward
def inline_burns_cpu(prompt, completion, seconds="0.5", **_):
    """Spends `seconds` of its own CPU time (a reward wrongly marked cheap)."""
    end = time.thread_time() + float(seconds)
    while time.thread_time() < end:
        pass
    return 1.0


def arealite_style(prompt, completions, prompt_ids, completion_ids, answer="42", **kwargs):
    """AReaL-lite's convention; the value proves which ids arrived: 100 * #prompt ids +
    #completion ids when the completion is right, else 0."""
    if completions.strip() != answer:
        return 0.0
    return float(100 * len(prompt_ids) + len(completion_ids))


def worker_pid(prompt, completion, hang=False, **_):
    """The worker's process id (as a float: rewards are numbers); hangs when told to."""
    import os

    if hang:
        time.sleep(3600)
    return float(os.getpid())


def even_length(prompt, completion, **_):
    """1 when the completion has an even number of characters: a reward that varies within
    every group even for an untrained model (so every GRPO step has a gradient)."""
    return float(len(completion) % 2 == 0)


def always_zero(prompt, completion, **_):
    """0 for every completion: a model that never earns a reward (every group's rewards are
    equal, so dynamic sampling rejects them all)."""
    return 0.0
