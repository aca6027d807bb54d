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
import areal_like.api.moe_config as moe_configs
import areal_like.api.rollout_config as rollout_configs
import recipes.configs as recipe_configs
from areal_like.api.io_struct import GenerationHyperparameters

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("areal_like", "engines", "workflows", "recipes")
DEFINITIONS = {REPO / "areal_like/api/config.py", REPO / "areal_like/api/algorithm_config.py",
               REPO / "areal_like/api/launcher_config.py", REPO / "areal_like/api/lora_config.py",
               REPO / "areal_like/api/moe_config.py", REPO / "areal_like/api/rollout_config.py",
               REPO / "recipes/configs.py"}


def _config_classes() -> list[type]:
    classes = [GenerationHyperparameters]
    for module in (base_configs, algorithm_configs, launcher_configs, lora_configs,
                   moe_configs, rollout_configs, recipe_configs):
        classes += [c for c in vars(module).values()
                    if dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    return list(dict.fromkeys(classes))  # an alias (SGLangServerConfig) is the same class


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


MAX_FIELDS = 20  # past this a section nests by concern (rollout.client, algorithm.kl, agent, ...)


def test_no_config_class_has_more_than_20_fields():
    """Inherited fields count: a recipe schema is what its user reads. AReaL-lite's mirror
    classes (areal_like.arealite.config) are not in this list: they keep AReaL-lite's schema."""
    counts = {c.__name__: len(dataclasses.fields(c)) for c in _config_classes()}
    assert max(counts.values()) <= MAX_FIELDS, {k: n for k, n in counts.items() if n > MAX_FIELDS}


def test_every_old_flat_key_has_a_new_place_that_exists():
    """`moved_keys` (old key -> new dotted place) names fields that exist, and no old key
    is still a field: each refusal message points somewhere real."""
    checked = 0
    for cls in _config_classes():
        for old, new in getattr(cls, "moved_keys", {}).items():
            node: object = cls
            for part in new.split("."):
                names = {f.name: f for f in dataclasses.fields(node)}
                assert part in names, f"{cls.__name__}.moved_keys[{old!r}] = {new!r}: no {part!r}"
                node = names[part].default_factory() if names[part].default_factory \
                    is not dataclasses.MISSING else names[part].default
            assert old not in {f.name for f in dataclasses.fields(cls)}
            checked += 1
    assert checked >= 40 + 24 + 4  # algorithm, rollout, agent
