"""Every config key does something: each field of every config dataclass is read somewhere
outside the config definitions (as an attribute that is not a method call, or by name in
`getattr`/a key string). A key nothing reads would let a user set it to no effect."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import areal_like.api.algorithm_config as algorithm_configs
import areal_like.api.config as base_configs
import areal_like.api.launcher_config as launcher_configs
import areal_like.api.lora_config as lora_configs
import recipes.configs as recipe_configs
from areal_like.api.io_struct import GenerationHyperparameters

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("areal_like", "engines", "workflows", "recipes")
DEFINITIONS = {REPO / "areal_like/api/config.py", REPO / "areal_like/api/algorithm_config.py",
               REPO / "areal_like/api/launcher_config.py", REPO / "areal_like/api/lora_config.py",
               REPO / "recipes/configs.py"}


def _config_classes() -> list[type]:
    classes = [GenerationHyperparameters]
    for module in (base_configs, algorithm_configs, launcher_configs, lora_configs,
                   recipe_configs):
        classes += [c for c in vars(module).values()
                    if dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    return classes


def _names_read() -> set[str]:
    """Attribute names loaded (not called, not `self.x`: a class's own state is no config
    read) and string constants, outside the definitions."""
    names: set[str] = set()
    for directory in CODE_DIRS:
        for path in (REPO / directory).rglob("*.py"):
            if path in DEFINITIONS:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                        and id(node) not in called and not _on_self(node)):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


FIELDS = [(cls.__name__, f.name) for cls in _config_classes() for f in dataclasses.fields(cls)]


def test_the_check_sees_the_config_classes():
    assert len(_config_classes()) >= 15 and len(FIELDS) >= 100


@pytest.mark.parametrize("cls,field", FIELDS, ids=[f"{c}.{f}" for c, f in FIELDS])
def test_every_config_field_is_read_somewhere(cls, field, names_read=_names_read()):
    assert field in names_read, (
        f"{cls}.{field} is read nowhere outside the config definitions: make it do "
        f"something or remove it")
