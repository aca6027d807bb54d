"""Checks that a reward function can work at all, run before the first training step.

The documented signature is `reward_fn(prompt, completion, **data)`, where `data` is the
dataset item (its `answer`, `id`, `messages`, ...). A function that cannot be called that way,
or that cannot be sent to reward worker processes (lambdas, closures, functions of a script
without a `__main__` guard), would otherwise fail on every call of a real run.
"""

from __future__ import annotations

import inspect
import pickle
import sys
from typing import Any, Callable, Optional

from areal_like.rewards.convention import call_arguments, reward_convention
from areal_like.rewards.failures import RewardFunctionError


def reward_name(fn: Callable[..., Any]) -> str:
    """A short, stable name for logs and metric keys (the function's qualified name, or
    the `areal_reward_name` of the object a bound method belongs to, e.g. a remote RM's URL)."""
    explicit = getattr(getattr(fn, "__self__", None), "areal_reward_name", None)
    if isinstance(explicit, str):
        return explicit
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn))
    return str(name).replace(".<locals>.", ".")


def where_defined(fn: Callable[..., Any]) -> str:
    """'module (file:line)' for error messages."""
    target = inspect.unwrap(fn)
    module = getattr(target, "__module__", "?")
    try:
        path = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
        return f"module {module} ({path}:{line})"
    except (TypeError, OSError):
        return f"module {module}"


def check_signature(fn: Callable[..., Any], data: Optional[dict[str, Any]] = None) -> None:
    """`fn` accepts one of the two conventions (`areal_like.rewards.convention`) for this data
    item; with `data` None only the fixed arguments are checked (data keys are not known yet)."""
    name = reward_name(fn)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {fn!r} is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature to check
    convention = reward_convention(fn)
    args, kwargs = call_arguments(fn, "prompt", "completion", data or {}, ([0], [0]))
    try:
        if data is None:
            sig.bind_partial(*args, **kwargs)
        else:
            sig.bind(*args, **kwargs)
    except TypeError as e:
        keys = f" with this dataset's keys {sorted(data)}" if data is not None else ""
        raise RewardFunctionError(
            f"reward function {name}{sig} (in {where_defined(fn)}) cannot be called as "
            f"reward_fn({convention}){keys}: {e}. A reward function takes either "
            f"(prompt, completion, **kwargs) or, as in AReaL-lite, (prompt, completions, "
            f"prompt_ids, completion_ids, **kwargs); the **kwargs receive the data item's keys "
            f"it does not name."
        ) from None


def check_picklable(fn: Callable[..., Any]) -> None:
    """`fn` can be sent to a worker process (pickled by reference to its module)."""
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {reward_name(fn)} (in {where_defined(fn)}) cannot be sent to "
            f"reward worker processes: {type(e).__name__}: {e}. Lambdas, closures and "
            f"functions defined inside other functions cannot be pickled: define it at the "
            f"top level of an importable module, or set reward.use_processes=false to run "
            f"rewards in threads (then a hanging call cannot be stopped)."
        ) from None


def worker_load_hint(fn: Callable[..., Any]) -> str:
    """What to do when a worker process cannot load `fn`."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    hints = []
    if getattr(fn, "__module__", "") in ("__main__", "__mp_main__"):
        hints.append("the function is defined in the script being run; move it into a module "
                     "or make sure the script imports cleanly")
    else:
        hints.append(f"check that module {fn.__module__!r} imports cleanly in a fresh Python "
                     f"process")
    if script:
        hints.append(f"worker processes start by importing the running script ({script}) "
                     f"again: guard its top-level code with `if __name__ == \"__main__\":`")
    return "; ".join(hints)
