"""Value checks for config dataclasses: the error names the class, the key and the value."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # my_pkg.module:name


def check(cls_name: str, key: str, ok: bool, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{cls_name}.{key}={value!r} is invalid: expected {expected}")


def one_of(cls_name: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    check(cls_name, key, value in choices, value, f"one of {choices}")


def address_list(cls_name: str, key: str, addrs: list) -> None:
    """Server addresses: each `host:port`."""
    for addr in addrs:
        host, _, port = str(addr).rpartition(":")
        check(cls_name, key, bool(host) and port.isdigit(), addr, "entries of the form host:port")


@dataclasses.dataclass(frozen=True)
class Bound:
    """A field's declared range: `ok(value)` and the text of what is expected."""

    expected: str
    ok: Callable[[Any], bool]


FRACTION = Bound("in [0, 1]", lambda v: 0.0 <= v <= 1.0)
FRACTION_BELOW_1 = Bound("in [0, 1)", lambda v: 0.0 <= v < 1.0)
FINITE = Bound("a finite number", lambda v: math.isfinite(v))


def at_least(low: float, unit: str = "") -> Bound:
    return Bound(f">= {low}{unit}", lambda v: v >= low)


def above(low: float, unit: str = "") -> Bound:
    return Bound(f"> {low}{unit}", lambda v: v > low)


def within(low: int, high: int) -> Bound:
    return Bound(f"in {low}..{high}", lambda v: low <= v <= high)


def choices(*options: str) -> Bound:
    return Bound(f"one of {options}", lambda v: v in options)


def cpu_ids() -> Bound:
    return Bound("distinct CPU ids >= 0 (empty: not pinned)",
                 lambda v: all(isinstance(c, int) and c >= 0 for c in v) and len(set(v)) == len(v))


def nonempty(what: str) -> Bound:
    return Bound(what, bool)


def bounded(default: Any = dataclasses.MISSING, *, bound: Bound,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose value `check_bounds` checks against `bound`."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"bound": bound})


def check_bounds(obj: Any, section: str) -> None:
    """Check every declared bound of dataclass `obj`; the error names `section.key`."""
    for f in dataclasses.fields(obj):
        bound = f.metadata.get("bound")
        if bound is not None:
            value = getattr(obj, f.name)
            check(section, f.name, bound.ok(value), value, bound.expected)


def moved_key_message(section_cls: Any, section: str, leaf: str) -> Optional[str]:
    """Where an old flat key of a section that now nests by concern went (the section's class
    lists them in `moved_keys`: old key -> new place, relative to the section):
    "'rollout.weight_transport' is now 'rollout.weights.transport'", else None."""
    new = getattr(section_cls, "moved_keys", {}).get(leaf)
    if new is None:
        return None
    where = f"{section}." if section else ""
    return f"'{where}{leaf}' is now '{where}{new}'"
