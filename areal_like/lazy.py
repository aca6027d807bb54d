"""Lazy re-exports for a package's `__init__` (PEP 562): a name is imported from its module on
first use, so importing the package stays cheap and an optional dependency fails only when
the name that needs it is used."""

from __future__ import annotations

import importlib
import sys
from typing import Any


class LazyExports:
    """`names` maps each exported name to the module that defines it."""

    def __init__(self, package: str, names: dict[str, str]) -> None:
        self.package = package
        self.names = names

    def get(self, name: str) -> Any:
        module = self.names.get(name)
        if module is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[self.package])[name] = value  # once: later lookups skip __getattr__
        return value

    def dir(self) -> list[str]:
        return sorted({*vars(sys.modules[self.package]), *self.names})
