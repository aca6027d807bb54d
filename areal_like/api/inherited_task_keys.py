"""Task parameters inherited from a config of another task type: found, so they can be dropped.

A YAML that extends ours (`defaults: [sft_addition, _self_]`) and sets
`train_dataset: {type: my_task:make_task, task_kwargs: {max_terms: 2}}` would, by Hydra's
key-by-key merge, also carry sft_addition's `task_kwargs: {num_digits: 2}` into a task that has
no such parameter. Which config set a key is not kept by Hydra, so it is found here by reading
the defaults chain in Hydra's merge order (a config's own keys after its defaults, unless its
list places `_self_` earlier; command-line overrides last): a layer that changes a section's
`type` drops the task keys (`task_kwargs` entries, `path`) that layers before it set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

TASK_KEYS = ("task_kwargs", "path")  # what belongs to one task type (path: gsm8k's file)
Layer = tuple[str, dict]  # (where it came from, its raw content)


@dataclass(frozen=True)
class InheritedKey:
    section: str  # "train_dataset"
    key: str  # "task_kwargs.num_digits" or "path"
    source: str  # the file that set it
    old_type: str  # the section's type in that file's view
    new_type: str  # the type the composed config ends with

    def notice(self) -> str:
        return (f"config: {self.section}.type is {self.new_type!r}, so {self.section}."
                f"{self.key} (set by {self.source} for type {self.old_type!r}) is dropped")


def inherited_task_keys(path: Path, overrides: list[str], search_dirs: list[Path],
                        sections: dict[str, str]) -> list[InheritedKey]:
    """The task keys of `sections` (`{section: its schema's default type}`) that the composed
    config would inherit from a layer whose type for that section differs from the final one."""
    layers = _file_layers(path, search_dirs, set()) + [("the command line",
                                                        _override_layer(overrides))]
    found: list[InheritedKey] = []
    for section, default_type in sections.items():
        found += _inherited_in(section, default_type, layers)
    return found


def _inherited_in(section: str, default_type: str, layers: list[Layer]) -> list[InheritedKey]:
    current = default_type
    live: dict[str, str] = {}  # {key: source} set for the current type
    stale: dict[str, tuple[str, str]] = {}  # {key: (source, its type)} dropped by a type change
    for source, layer in layers:
        content = layer.get(section)
        if not isinstance(content, dict):
            continue
        new_type = content.get("type", current)
        if not isinstance(new_type, str) or "${" in new_type:
            return []  # an interpolated type: which task it is shows only after resolution
        if new_type != current:
            stale.update({key: (where, current) for key, where in live.items()})
            current, live = new_type, {}
        for key in _task_keys(content):
            live[key] = source
            stale.pop(key, None)
    return [InheritedKey(section, key, where, old, current)
            for key, (where, old) in sorted(stale.items())]


def _task_keys(content: dict) -> list[str]:
    keys = [k for k in TASK_KEYS if k in content and k != "task_kwargs"]
    kwargs = content.get("task_kwargs")
    if isinstance(kwargs, dict):
        keys += [f"task_kwargs.{k}" for k in kwargs]
    return keys


def _file_layers(path: Path, search_dirs: list[Path], seen: set[Path]) -> list[Layer]:
    """The YAML files composed for `path`, in merge order (schemas have no file: skipped)."""
    if path in seen:  # Hydra refuses a cycle itself
        return []
    seen = seen | {path}
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(raw, dict):
        return []
    defaults = raw.pop("defaults", None) or []
    own: Layer = (path.name, raw)
    layers: list[Layer] = []
    for entry in defaults:
        if entry == "_self_":
            layers.append(own)
            own = ("", {})
        elif isinstance(entry, str):
            found = _find(entry, [path.parent, *search_dirs])
            if found is not None:
                layers += _file_layers(found, search_dirs, seen)
    return layers + [own]  # without `_self_`, Hydra (1.1+) merges the file's own keys last


def _find(name: str, dirs: list[Path]) -> Optional[Path]:
    for folder in dirs:
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            return candidate.resolve()
    return None


OVERRIDE = re.compile(r"\+*(\w+)\.(type|path|task_kwargs(?:\.\w+)?)=(.*)")


def _override_layer(overrides: list[str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for override in overrides:
        found = OVERRIDE.fullmatch(override)
        if found is None:
            continue
        section, key, value = found.groups()
        content = layer.setdefault(section, {})
        container = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))
        assert isinstance(container, dict)
        parsed = container["v"]
        if key.startswith("task_kwargs."):
            kwargs = content.setdefault("task_kwargs", {})
            if isinstance(kwargs, dict):
                kwargs[key.split(".", 1)[1]] = parsed
        else:
            content[key] = parsed
    return layer
