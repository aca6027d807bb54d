"""Reading a request's fields at the boundary: each reader takes one key of a JSON object,
checks its type and range, and raises `UserError` naming the key and the value — so a wrong
type is the caller's 400, never a `ValueError` deep inside (a 500) or a value read wrongly
(`bool("false")` is true)."""

from __future__ import annotations

import math
from typing import Any, Optional

from areal_like.tinker.errors import UserError

_MISSING = object()


def _value(body: Any, key: str, default: Any) -> Any:
    if not isinstance(body, dict):
        raise UserError(f"{key.rsplit('.', 1)[0]}: expected a JSON object, got "
                        f"{type(body).__name__}")
    value = body.get(key.rsplit(".", 1)[-1], _MISSING)
    return default if value is _MISSING or value is None else value


def integer(body: Any, key: str, default: Optional[int] = None, low: Optional[int] = None,
            high: Optional[int] = None) -> int:
    """`body[key]` as an int within [low, high] (a dotted key names where it sits)."""
    value = _value(body, key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not value.is_integer()):
        raise UserError(f"{key}={value!r}: expected an integer")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{'' if low is None else low}..{'' if high is None else high}"
        raise UserError(f"{key}={value}: expected an integer in {bounds}")
    return value


def number(body: Any, key: str, default: Optional[float] = None) -> float:
    """`body[key]` as a finite float."""
    value = _value(body, key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise UserError(f"{key}={value!r}: expected a finite number")
    return float(value)


def flag(body: Any, key: str, default: bool) -> bool:
    """`body[key]` as a JSON boolean (a string such as "false" is refused, not read as true)."""
    value = _value(body, key, default)
    if not isinstance(value, bool):
        raise UserError(f"{key}={value!r}: expected true or false")
    return value


def mapping(body: Any, key: str) -> dict[str, Any]:
    """`body[key]` as a JSON object ({} when absent)."""
    value = _value(body, key, {})
    if not isinstance(value, dict):
        raise UserError(f"{key}={value!r}: expected a JSON object")
    return value


def adam_params(given: Optional[dict[str, Any]]) -> dict[str, float]:
    """optim_step's adam_params with the SDK's defaults filled, checked."""
    if given is None:
        raise UserError("optim_step without adam_params: this server steps AdamW only")
    defaults = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                "weight_decay": 0.0, "grad_clip_norm": 0.0}
    adam = {k: number(given, f"adam_params.{k}", v) for k, v in defaults.items()}
    if adam["learning_rate"] < 0 or not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1) \
            or adam["eps"] <= 0 or adam["weight_decay"] < 0 or adam["grad_clip_norm"] < 0:
        raise UserError(f"adam_params {adam}: need learning_rate >= 0, betas in [0, 1), "
                        f"eps > 0, weight_decay >= 0, grad_clip_norm >= 0 (0: no clipping)")
    return adam
