"""The two calling conventions of a reward function, told apart by its signature.

- ours: `reward_fn(prompt, completion, **data)`;
- AReaL-lite's: `reward_fn(prompt, completions, prompt_ids, completion_ids, **data)` (a
  function with a parameter named `completions`, `prompt_ids` or `completion_ids`), called with
  keywords, `completions` being the one decoded completion and the ids those sent and generated.

Deliberately imports nothing heavy: reward worker processes use it too.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

OURS = "prompt, completion, **data"
AREALITE = "prompt, completions, prompt_ids, completion_ids, **data"
_AREALITE_NAMES = ("completions", "prompt_ids", "completion_ids")

TokenIds = Optional[tuple[list[int], list[int]]]  # (prompt ids, completion ids)


def reward_convention(fn: Callable[..., Any]) -> str:
    """`AREALITE` if `fn` names a parameter only AReaL-lite's convention has, else `OURS`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return OURS  # builtins and some C callables have no signature: called as ours
    return AREALITE if any(n in params for n in _AREALITE_NAMES) else OURS


def call_arguments(fn: Callable[..., Any], prompt: str, completion: str,
                   data: dict[str, Any], ids: TokenIds = None
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) to call `fn` with in its own convention."""
    if reward_convention(fn) == OURS:
        return (prompt, completion), data
    prompt_ids, completion_ids = ids if ids is not None else (None, None)
    return (), {"prompt": prompt, "completions": completion, "prompt_ids": prompt_ids,
                "completion_ids": completion_ids, **data}


def invoke(fn: Callable[..., Any], prompt: str, completion: str, data: dict[str, Any],
           ids: TokenIds = None) -> Any:
    """`fn`'s raw return value (or its coroutine), called in its own convention."""
    args, kwargs = call_arguments(fn, prompt, completion, data, ids)
    return fn(*args, **kwargs)
