"""Functions run inside reward worker processes; deliberately imports nothing heavy."""

from __future__ import annotations

from typing import Any, Callable


def call_reward(fn: Callable[..., Any], prompt: str, completion: str, data: dict[str, Any]) -> Any:
    return fn(prompt, completion, **data)


def ready() -> bool:
    return True
