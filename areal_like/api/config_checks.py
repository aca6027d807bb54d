"""Value checks for config dataclasses: the error names the class, the key and the value."""

from __future__ import annotations

import re

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # my_pkg.module:name


def check(cls_name: str, key: str, ok: bool, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{cls_name}.{key}={value!r} is invalid: expected {expected}")


def one_of(cls_name: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    check(cls_name, key, value in choices, value, f"one of {choices}")


def cpu_list(cls_name: str, key: str, cpus: list) -> None:
    """CPU ids to pin to (the machine is not known yet): distinct ids >= 0; empty: not pinned."""
    ok = all(isinstance(c, int) and c >= 0 for c in cpus) and len(set(cpus)) == len(cpus)
    check(cls_name, key, ok, list(cpus), "distinct CPU ids >= 0 (empty: not pinned)")


def address_list(cls_name: str, key: str, addrs: list) -> None:
    """Server addresses: each `host:port`."""
    for addr in addrs:
        host, _, port = str(addr).rpartition(":")
        check(cls_name, key, bool(host) and port.isdigit(), addr, "entries of the form host:port")
