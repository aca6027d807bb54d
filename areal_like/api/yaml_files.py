"""Read a config YAML, and the YAML files its defaults list names, before Hydra composes them.

PyYAML and Hydra report a tab, a key given twice or a list at the top as a traceback (or as a
message that names neither the file nor the line); here each fault is one line,
`<file>:<line>:<col>: <what is wrong>`, and an included file's fault also names the file whose
defaults list brought it in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import yaml


class YAMLFileError(ValueError):
    """A config YAML cannot be used; the message starts with `<file>:<line>:<col>:`."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping, as OmegaConf's loader
    does, but with both places (OmegaConf names only the second)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                continue  # merge keys (`<<: *base`) may be overridden: YAML's own rule
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first set at line "
                    f"{first[key].line + 1})", key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _describe(problem: str, context: str, line_text: str, column: int) -> str:
    """What a PyYAML error means, in the words the user needs."""
    if "'\\t'" in problem or "tab character" in problem:
        if not line_text[:column].strip():
            return "a tab character cannot indent YAML (indent with spaces)"
        return "a tab character cannot separate YAML tokens (use a space)"
    return f"{problem} ({context})" if context else problem


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    return f"a single value ({value!r})"


def read_yaml(path: Path, required: bool = True) -> Optional[dict[str, Any]]:
    """The mapping at the top of the YAML at `path` (None for an empty file when not
    `required`); a fault raises `YAMLFileError` naming `path` as given, line and column."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise YAMLFileError(f"{path}: cannot be read: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise YAMLFileError(f"{path}:{line}:{column}: not UTF-8 text (byte "
                            f"0x{data[e.start]:02x}); save the file as UTF-8") from e
    loader = _StrictLoader(text)
    try:
        root = loader.get_single_node()
        value = None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, column = (mark.line, mark.column) if mark is not None else (0, 0)
        lines = text.splitlines()
        what = _describe(e.problem or "", e.context or "",
                         lines[line] if line < len(lines) else "", column)
        raise YAMLFileError(f"{path}:{line + 1}:{column + 1}: {what}") from e
    except yaml.YAMLError as e:  # no position known (e.g. a second document)
        raise YAMLFileError(f"{path}: not valid YAML: {e}") from e
    finally:
        loader.dispose()
    if value is None:
        if required:
            raise YAMLFileError(f"{path}: the file is empty (nothing but blanks or comments); "
                                f"a config YAML is a mapping that starts with "
                                f"`defaults: [<schema name>, _self_]`")
        return None
    if not isinstance(value, dict):
        mark = root.start_mark
        raise YAMLFileError(f"{path}:{mark.line + 1}:{mark.column + 1}: a config YAML must be "
                            f"a mapping (`key: value` lines) at the top; this one is "
                            f"{_kind(value)}")
    return value


def _included(entry: Any) -> list[str]:
    """The config names (`name` or `group/option`) a defaults-list entry refers to."""
    if isinstance(entry, str):
        return [] if entry == "_self_" or "${" in entry else [entry]
    if not isinstance(entry, dict) or len(entry) != 1:
        return []  # Hydra explains a malformed entry itself
    key, value = next(iter(entry.items()))
    group = str(key).split()[-1].split("@", 1)[0]  # `optional g`, `override g`, `g@package`
    options = value if isinstance(value, list) else [value]
    return [f"{group}/{o}" for o in options
            if isinstance(o, str) and o not in ("???", "null") and "${" not in o]


def check_yaml_tree(path: Path, search_dirs: Sequence[Path]) -> list[str]:
    """Read the YAML at `path` and, recursively, every YAML file its defaults list names (found
    in the including file's folder, `path`'s folder or `search_dirs`); raise `YAMLFileError`
    at the first fault. Returns the names with no file: registered schemas (or Hydra's
    error)."""
    roots = [path.parent, *search_dirs]
    seen: set[Path] = set()
    without_file: list[str] = []

    def visit(file: Path, named_by: Optional[Path]) -> None:
        seen.add(file.resolve())
        try:
            raw = read_yaml(file, required=named_by is None)
        except YAMLFileError as e:
            if named_by is None:
                raise
            raise YAMLFileError(f"{e} (a file the defaults list of {named_by} names)") from e
        defaults = (raw or {}).get("defaults")
        for entry in defaults if isinstance(defaults, list) else []:
            for name in _included(entry):
                folders = roots if name.startswith("/") else [file.parent, *roots]
                for folder in folders:
                    candidate = folder / f"{name.lstrip('/')}.yaml"
                    if candidate.is_file():
                        if candidate.resolve() not in seen:
                            visit(candidate, file)
                        break
                else:
                    without_file.append(name.lstrip("/"))

    visit(path, None)
    return without_file
