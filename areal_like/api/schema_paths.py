"""Dotted keys into a config schema (its dataclasses): the section a key names, its fields,
and what a command-line override of a switch may say."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, get_type_hints

SWITCH_VALUES = ("true", "false")


def class_at(config_cls: type, dotted_parent: str) -> Optional[type]:
    """The dataclass found by following `dotted_parent` from `config_cls`, else None."""
    cls: Any = config_cls
    for part in [p for p in dotted_parent.split(".") if p]:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def fields_at(config_cls: type, dotted_parent: str) -> Optional[list[str]]:
    """Field names of the dataclass found by following `dotted_parent` from `config_cls`."""
    cls = class_at(config_cls, dotted_parent)
    return None if cls is None else [f.name for f in dataclasses.fields(cls)]


def switch_error(config_cls: type, overrides: list[str]) -> Optional[str]:
    """Why an override sets a switch (a bool key) to anything but true/false, else None:
    OmegaConf would read `async_save=2` or `=yes` as true."""
    for override in overrides:
        found = re.fullmatch(r"\+*([\w.]+)=(.*)", override)
        if not found:
            continue
        key, value = found.groups()
        parent, _, leaf = key.rpartition(".")
        cls = class_at(config_cls, parent)
        if cls is None or get_type_hints(cls).get(leaf) is not bool:
            continue
        if value.strip().lower() not in SWITCH_VALUES:
            return f"{key}={value}: {key} is a switch; expected true or false"
    return None
