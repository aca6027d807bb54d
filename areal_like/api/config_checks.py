"""Value checks for config dataclasses: the error names the class, the key and the value."""

from __future__ import annotations

import re

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # my_pkg.module:name


def check(cls_name: str, key: str, ok: bool, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{cls_name}.{key}={value!r} is invalid: expected {expected}")


def one_of(cls_name: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    check(cls_name, key, value in choices, value, f"one of {choices}")
