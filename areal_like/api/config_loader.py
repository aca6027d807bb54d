"""Compose a recipe config from YAML + command-line overrides with Hydra, into a dataclass.

A recipe YAML starts with a defaults list naming its registered schema:

    defaults:
      - grpo_schema      # registered with register_schema("grpo_schema", GRPOConfig)
      - _self_

`load_config` composes it with Hydra (so overrides use Hydra's grammar:
`actor.optimizer.lr=1e-5 rollout.server_addrs=[127.0.0.1:30000]`), converts the result to
the dataclass (running every `__post_init__` check) and turns OmegaConf's errors into a
`ConfigError` naming the key at fault and the closest valid keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, TypeVar, cast, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from areal_like.api.algorithm_presets import AlgorithmKeyError, preset_values
from areal_like.api.arealite_keys import (
    ArealiteKeyError,
    arealite_only,
    looks_like_arealite,
    translate_arealite,
)
from areal_like.api.config_checks import moved_key_message
from areal_like.api.inherited_task_keys import inherited_task_keys
from areal_like.api.schema_paths import class_at, fields_at, switch_error
from areal_like.api.yaml_files import YAMLFileError, check_yaml_tree

T = TypeVar("T")


class ConfigError(ValueError):
    """A config could not be composed or validated; the message names the key at fault."""


_SEARCH_DIRS: list[Path] = []


def register_config_dir(path: str | Path) -> None:
    """Put `path` on every composition's search path (after the YAML's own folder), so a YAML
    anywhere can name the configs there in its defaults list."""
    path = Path(path).resolve()
    if path not in _SEARCH_DIRS:
        _SEARCH_DIRS.append(path)


def _check_yaml_files(config_file: str | Path) -> None:
    """A tab, a duplicate key, a top level that is not a mapping, an empty or unreadable file,
    in `config_file` or a YAML its defaults list names, as `<file>:<line>:<col>: <what>`
    (before Hydra, whose own errors name neither file nor line)."""
    path = Path(config_file)
    if not path.is_file():
        return  # `_compose` says so
    try:
        check_yaml_tree(path, _SEARCH_DIRS)
    except YAMLFileError as e:
        raise ConfigError(str(e)) from e


def _missing_config(exc: BaseException, path: Path) -> Optional[str]:
    """A readable message for a defaults-list entry Hydra could not find, else None."""
    inner = exc
    while inner.__cause__ is not None and not isinstance(inner, MissingConfigException):
        inner = inner.__cause__
    if not isinstance(inner, MissingConfigException):
        return None
    found = re.search(r"Could not (?:find|load) '([^']+)'", str(inner))
    name = found.group(1) if found else "?"
    dirs = [path.parent, *[d for d in _SEARCH_DIRS if d != path.parent]]
    where = " or ".join(str(d / f"{name}.yaml") for d in dirs)
    options = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"{path}: its defaults list names '{name}', but there is no {where} (and no "
            f"registered schema of that name); {hint}configs there: {options}")


# registered schemas not yet in Hydra's store: storing one builds its whole OmegaConf tree
# (~0.1 s a schema), so every process that imports the recipes' configs would pay for all of
# them; they are stored when a config is first composed
_UNSTORED_SCHEMAS: dict[str, type] = {}


def register_schema(name: str, config_cls: type) -> None:
    """Make `config_cls` available to YAML defaults lists as `name`."""
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"register_schema({name!r}): {config_cls!r} is not a dataclass")
    _UNSTORED_SCHEMAS[name] = config_cls


def _store_schemas(names: Optional[list[str]] = None) -> None:
    """Put registered schemas (`names`, or all) into Hydra's store before a compose reads it."""
    for name in list(_UNSTORED_SCHEMAS) if names is None else names:
        config_cls = _UNSTORED_SCHEMAS.pop(name, None)
        if config_cls is not None:
            ConfigStore.instance().store(name=name, node=config_cls)


def _section_types(path: Path, overrides: list[str]) -> dict[str, Any]:
    """`{section: its type}` for the sections of the YAML at `path` that have a `type` key (and
    `section.type=` overrides): what a typo's hint depends on. Best effort: {} on any failure."""
    types: dict[str, Any] = {}
    try:
        _store_schemas()
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            composed = compose(config_name=path.stem, overrides=[
                f"hydra.searchpath=[{','.join(f'file://{d}' for d in _SEARCH_DIRS)}]"])
        types = {str(k): v.get("type") for k, v in composed.items() if OmegaConf.is_dict(v)}
    except Exception:  # noqa: BLE001 - only a hint; the caller raises the real error
        pass
    finally:
        GlobalHydra.instance().clear()
    for o in overrides:
        found = re.fullmatch(r"\+*([\w.]+)\.type=(.*)", o)
        if found:
            types[found.group(1)] = found.group(2)
    return types


def _full_key(exc: BaseException) -> Optional[str]:
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return str(seen.full_key)
        match = re.search(r"full_key: (\S+)", str(seen))
        if match:
            return match.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def _root_message(exc: BaseException) -> str:
    """The innermost message, without OmegaConf's multi-line object dump."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    lines = [ln for ln in str(inner).splitlines() if ln.strip()]
    for prefix in ("full_key:", "reference_type", "object_type"):
        lines = [ln for ln in lines if not ln.strip().startswith(prefix)]
    text = " ".join(ln.strip() for ln in lines) or type(inner).__name__
    text = re.sub(r"^In '[^']*': \w+ raised while composing config: ", "", text)
    return text if len(text) <= 400 else text[:400] + " ..."  # merge errors dump whole configs


def explain_config_error(exc: BaseException, config_cls: type, source: str,
                         section_types: Optional[dict[str, Any]] = None) -> ConfigError:
    """Build a `ConfigError` from a Hydra/OmegaConf exception raised while composing;
    `section_types` (`{section: its type key}`) narrows a typo's hint to the keys valid for
    that type (e.g. a reasoning-gym task's own parameters)."""
    key = _full_key(exc)
    message = _root_message(exc)
    if key is None:
        return ConfigError(f"{source}: {message}")
    parent, _, leaf = key.rpartition(".")
    leaf = re.sub(r"\[.*\]$", "", leaf)
    valid = fields_at(config_cls, parent) or []
    section = class_at(config_cls, key)
    if leaf in valid and section is not None and "is not Optional" in message:
        return ConfigError(f"{source}: config key '{key}' is a section ({section.__name__}) "
                           f"and cannot be null here: leave it out for its defaults, or set "
                           f"its keys")
    if leaf in valid:
        return ConfigError(f"{source}: bad value for config key '{key}': {message}")
    moved = moved_key_message(class_at(config_cls, parent), parent, leaf)
    if moved:
        return ConfigError(f"{source}: bad config key '{key}': {moved}")
    cls, hint, params = class_at(config_cls, parent), "", []
    if cls is not None and hasattr(cls, "suggestable_keys"):  # keys depend on the section's type
        valid, params = cls.suggestable_keys((section_types or {}).get(parent))
    if valid:
        where = f"'{parent}'" if parent else "the top level"
        names = [f"{parent}.{c}" if parent else c
                 for c in difflib.get_close_matches(leaf, valid, n=3, cutoff=0.5)]
        names += [f"{parent}.task_kwargs.{c}"
                  for c in difflib.get_close_matches(leaf, params, n=3, cutoff=0.5)]
        hint = (f"; did you mean {' or '.join(repr(n) for n in names)}?"
                if names else f"; valid keys under {where}: {valid}")
        if params:
            hint += f" (parameters of this task, under task_kwargs: {params})"
        free = [f for f in valid if _inside_a_dict(config_cls, f"{parent}.{f}.x".lstrip("."))]
        if free and not params:  # e.g. a task's own parameter, under task_kwargs
            hint += (f" (or, as a free-form key: "
                     f"'{'.'.join(p for p in (parent, free[0], leaf) if p)}')")
    return ConfigError(f"{source}: bad config key '{key}': {message}{hint}")


def _inside_a_dict(config_cls: type, override: str) -> bool:
    """Whether `override` sets a key inside a `Dict[...]` field of `config_cls` (whose keys are
    free, like `train_dataset.task_kwargs.min_terms`)."""
    cls: Any = config_cls
    parts = override.split("=", 1)[0].split(".")
    for part in parts[:-1]:
        if not dataclasses.is_dataclass(cls):
            return False
        hint = get_type_hints(cls).get(part)
        if hint is None:
            return False
        if getattr(hint, "__origin__", None) is dict:
            return True
        cls = hint
    return False


LEGACY_OVERRIDES = {f"logging.wandb={v}": f"logging.wandb.enabled={v}" for v in ("true", "false")}


def _compose(config_cls: type, config_file: str | Path, overrides: Optional[list[str]],
             drop_inherited: bool = True) -> tuple[Any, str]:
    """(the composed DictConfig, a description of its source for errors)."""
    path = Path(config_file).resolve()
    if not path.is_file():
        raise ConfigError(f"config file {str(config_file)!r} does not exist")
    # `logging.wandb=true` (a switch before the trackers had sections) still switches it on
    overrides = [LEGACY_OVERRIDES.get(o.lower(), o) for o in overrides or []]
    # a key inside a free-form dict is added or replaced without Hydra's `+`/`++`
    overrides = [f"++{o}" if o[:1] not in "+~" and _inside_a_dict(config_cls, o) else o
                 for o in overrides]
    source = f"{path.name} with overrides {overrides}" if overrides else path.name
    refused = switch_error(config_cls, overrides)
    if refused:
        raise ConfigError(refused)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    search = [f"file://{d}" for d in _SEARCH_DIRS if d != path.parent]
    hydra_overrides = [f"hydra.searchpath=[{','.join(search)}]"] if search else []
    try:  # the schemas its defaults lists name (a YAML fault: every schema, Hydra names it)
        _store_schemas(check_yaml_tree(path, _SEARCH_DIRS))
    except YAMLFileError:
        _store_schemas()
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            composed = compose(config_name=path.stem, overrides=[*hydra_overrides, *overrides])
    except Exception as e:  # Hydra wraps OmegaConf's errors; re-raise naming the key
        missing = _missing_config(e, path)
        if missing:
            raise ConfigError(missing) from e
        raise explain_config_error(e, config_cls, source, _section_types(path, overrides)) from e
    if drop_inherited:
        _drop_inherited_task_keys(composed, config_cls, path, overrides)
    return composed, source


def _drop_inherited_task_keys(composed: Any, config_cls: type, path: Path,
                              overrides: list[str]) -> None:
    """A dataset section whose `type` a config changes keeps no parameter of the old task
    (see inherited_task_keys); each drop is one line on stderr (once per run: rank 0)."""
    sections = {name: getattr(cls, "type", "") for name, cls in _dataclass_fields(config_cls)
                if hasattr(cls, "suggestable_keys") and name in composed}
    if not sections:
        return
    for found in inherited_task_keys(path, overrides, _SEARCH_DIRS, sections):
        node = composed[found.section]
        if found.key == "path":
            node.path = ""
        else:
            kwargs = node.task_kwargs
            key = found.key.split(".", 1)[1]
            if key in kwargs:
                with open_dict(kwargs):  # Hydra composes in struct mode
                    del kwargs[key]
        if os.environ.get("RANK", "0") == "0":
            print(found.notice(), file=sys.stderr, flush=True)


def _dataclass_fields(config_cls: type) -> list[tuple[str, Any]]:
    if not dataclasses.is_dataclass(config_cls):
        return []
    return list(get_type_hints(config_cls).items())


def _to_object(composed: Any, config_cls: type[T], source: str) -> T:
    missing = sorted(OmegaConf.missing_keys(composed))
    if missing:
        raise ConfigError(f"{source}: required config value(s) not set (still '???'): "
                          f"{missing}; set them with key=value overrides")
    try:
        return cast(T, OmegaConf.to_object(composed))
    except OmegaConfBaseException as e:
        raise explain_config_error(e, config_cls, source) from e
    except ValueError as e:  # a dataclass __post_init__ check: already names the key
        raise ConfigError(f"{source}: {e}") from e


def load_config(
    config_cls: type[T], config_file: str | Path, overrides: Optional[list[str]] = None
) -> T:
    """Compose `config_file` (+ `overrides`) into a validated `config_cls` instance (an
    AReaL-lite experiment YAML is read through `arealite_keys`)."""
    _check_yaml_files(config_file)
    path = Path(config_file).resolve()
    if _is_arealite_yaml(path):
        return _load_arealite(config_cls, path, overrides or [], for_launcher=False)
    composed, source = _compose(config_cls, path, overrides)
    schema = OmegaConf.get_type(composed)
    if schema is not config_cls and isinstance(schema, type) and issubclass(config_cls, schema):
        try:  # a schema extending the YAML's (e.g. AReaL-lite's classes): its defaults fill in
            composed = OmegaConf.merge(OmegaConf.structured(config_cls),
                                       OmegaConf.to_container(composed, resolve=False))
        except OmegaConfBaseException as e:
            raise explain_config_error(e, config_cls, source) from e
    elif schema is not config_cls:
        raise ConfigError(
            f"{path}: its defaults list does not name the schema of {config_cls.__name__} "
            f"(add `defaults: [<schema name>, _self_]` at the top)"
        )
    _apply_algorithm_preset(composed, path, overrides or [], source)
    return _to_object(composed, config_cls, source)


def load_launch_config(base_cls: type[T], config_file: str | Path,
                       overrides: Optional[list[str]] = None) -> T:
    """The config of a user's script, for a launcher: fully validated when its defaults list
    names a registered schema; otherwise only the sections `base_cls` knows are read into it
    (the script validates the rest itself) — unknown keys inside those sections still fail."""
    overrides = list(overrides or [])
    _check_yaml_files(config_file)
    if _is_arealite_yaml(Path(config_file)):
        return _load_arealite(base_cls, Path(config_file), overrides, for_launcher=True)
    composed, source = _compose(base_cls, config_file, [], drop_inherited=False)
    schema = OmegaConf.get_type(composed)
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return cast(T, load_config(schema, config_file, overrides))
    known = set(fields_at(base_cls, "") or [])
    # a schemaless YAML: the overrides of our sections are applied here, the script's own
    # keys are the script's business
    mine = [o for o in overrides if o.lstrip("+~").split(".", 1)[0].split("=", 1)[0] in known]
    _drop_inherited_task_keys(composed, base_cls, Path(config_file).resolve(), mine)
    ours = {k: composed[k] for k in composed if k in known}
    source = f"{source} with overrides {mine}" if mine else source
    try:
        merged = OmegaConf.merge(OmegaConf.structured(base_cls), ours,
                                 OmegaConf.from_dotlist([o.lstrip("+") for o in mine]))
    except OmegaConfBaseException as e:
        raise explain_config_error(e, base_cls, source) from e
    _apply_algorithm_preset(merged, Path(config_file).resolve(), mine, source)
    return _to_object(merged, base_cls, source)


def _apply_algorithm_preset(composed: Any, path: Path, overrides: list[str],
                            source: str) -> None:
    """Put the values of `algorithm.preset` under the keys the YAML chain and the overrides
    set themselves (in place): a preset is overridden key by key."""
    name = OmegaConf.select(composed, "algorithm.preset", default=None)
    if not name:
        return
    try:
        values = preset_values(str(name))
    except AlgorithmKeyError as e:
        raise ConfigError(f"{source}: {e}") from None
    explicit = _algorithm_keys_set_by(path, set()) | {
        o.lstrip("+~").split("=", 1)[0][len("algorithm."):]
        for o in overrides if o.lstrip("+~").startswith("algorithm.")}
    for key, value in _flatten(values):
        if not any(key == k or key.startswith(f"{k}.") for k in explicit):
            OmegaConf.update(composed, f"algorithm.{key}", value, merge=False)


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _algorithm_keys_set_by(path: Path, seen: set[Path]) -> set[str]:
    """The dotted keys under `algorithm` that the YAML at `path` and the YAMLs its defaults list
    names (not the registered schemas) set."""
    if path in seen or not path.is_file():
        return set()
    seen.add(path)
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(raw, dict):
        return set()
    keys: set[str] = set()
    for entry in raw.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":
            for folder in [path.parent, *_SEARCH_DIRS]:
                keys |= _algorithm_keys_set_by((folder / f"{entry}.yaml").resolve(), seen)
    section = raw.get("algorithm")
    if isinstance(section, dict):
        keys |= {k for k, _ in _flatten(section)}
    return keys


def to_yaml(config: Any) -> str:
    """The config as YAML (what a run saves next to its logs)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _is_arealite_yaml(path: Path) -> bool:
    """An AReaL-lite experiment config: no defaults list, and AReaL-lite's own keys."""
    if not path.is_file():
        return False  # `_compose` says so
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except OmegaConfBaseException:
        return False  # `_compose` explains it
    return (isinstance(raw, dict) and "defaults" not in raw
            and looks_like_arealite({str(k): v for k, v in raw.items()}))


def _load_arealite(config_cls: type[T], path: Path, overrides: list[str],
                   for_launcher: bool) -> T:
    """An AReaL-lite YAML (+ overrides in either key names) into `config_cls`: the YAML is
    composed, overridden, resolved, then translated (`translate_arealite`). `model.path=X`
    sets `actor.path`, so AReaL-lite's `${actor.path}` references follow it. A launcher reads
    only the sections `config_cls` has, and leaves the notices to the script."""
    path = path.resolve()
    source = f"{path.name} with overrides {overrides}" if overrides else path.name
    composed, _ = _compose(config_cls, path, [], drop_inherited=False)
    raw = OmegaConf.create(OmegaConf.to_container(composed, resolve=False))
    try:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        model_path = OmegaConf.select(raw, "model.path")
        if model_path and OmegaConf.select(raw, "actor") is not None:
            raw.actor.path = model_path
        resolved = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {_root_message(e)}") from e
    try:
        top = fields_at(config_cls, "") or []
        assert isinstance(resolved, dict)  # a YAML mapping: _is_arealite_yaml checked it
        ours, said = translate_arealite({str(k): v for k, v in resolved.items()},
                                        top.__contains__)
    except ArealiteKeyError as e:
        raise ConfigError(f"{source}: {e}") from None
    _drop_arealite_only(ours, config_cls, "", lenient=for_launcher)
    if not for_launcher and os.environ.get("RANK", "0") == "0":
        for line in said:
            print(f"config (AReaL-lite): {line}", file=sys.stderr, flush=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(config_cls), ours)
    except OmegaConfBaseException as e:
        raise explain_config_error(e, config_cls, source) from e
    return _to_object(merged, config_cls, source)


def _drop_arealite_only(node: dict[str, Any], config_cls: type, parent: str,
                        lenient: bool) -> None:
    """Remove the AReaL-lite keys `config_cls` has no field for (they were mapped to ours);
    `lenient`: also whole top-level sections it lacks (a script's own)."""
    fields = fields_at(config_cls, parent)
    if fields is None:
        return  # a free-form dict
    for key in list(node):
        if key not in fields:
            if arealite_only(parent, key) or (lenient and not parent):
                del node[key]
        elif isinstance(node[key], dict):
            _drop_arealite_only(node[key], config_cls, f"{parent}.{key}".lstrip("."), lenient)
