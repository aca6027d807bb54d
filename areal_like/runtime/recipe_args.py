"""Command-line parsing for recipes: `--config FILE` plus Hydra overrides `key=value`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional, TypeVar

from areal_like.api.config_loader import ConfigError, load_config
from areal_like.runtime.preflight import check_recipe_config

T = TypeVar("T")
CONF_DIR = Path(__file__).resolve().parents[2] / "recipes" / "conf"


_OPTIONS = {"--config": "config", "--config-path": "path", "-cp": "path",
            "--config-name": "name", "-cn": "name"}


def split_args(argv: list[str], default_config: str) -> tuple[Path, list[str]]:
    """(config file, overrides) from `[--config FILE | --config-path DIR --config-name NAME]
    [key=value ...]` (Hydra's `-cp`/`-cn` too; NAME with or without `.yaml`)."""
    given: dict[str, str] = {}
    overrides, args = [], list(argv)
    while args:
        arg = args.pop(0)
        option, eq, value = arg.partition("=")
        if option in _OPTIONS:
            if not eq:
                if not args:
                    raise ConfigError(f"{option} needs a value")
                value = args.pop(0)
            given[_OPTIONS[option]] = value
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}: recipes take --config FILE (or "
                              f"--config-path DIR --config-name NAME) and key=value overrides")
        else:
            overrides.append(arg)
    if "config" in given and ({"path", "name"} & set(given)):
        raise ConfigError("give either --config FILE or --config-path/--config-name, not both")
    if "config" in given:
        return Path(given["config"]), overrides
    if "name" in given:
        name = given["name"] if given["name"].endswith(".yaml") else given["name"] + ".yaml"
        return Path(given.get("path", CONF_DIR)) / name, overrides
    if "path" in given:
        raise ConfigError("--config-path needs --config-name NAME (the YAML in that folder)")
    return CONF_DIR / default_config, overrides


def parse_recipe_args(config_cls: type[T], default_config: str,
                      argv: Optional[list[str]] = None) -> T:
    """The validated config, or exit 2 with the error naming the bad key (no traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides = split_args(argv, default_config)
        config = load_config(config_cls, path, overrides)
        check_recipe_config(config)  # sizes, task parameters, user code: before any start-up
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    set_threads(config)
    return config


def set_threads(config: Any) -> None:
    """Without OMP_NUM_THREADS (a recipe run by hand, not by a launcher), use
    `launcher.threads_per_trainer` threads (1 by default) here and in the processes this one
    starts, as the launchers do: on a few cores, more threads per process are slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    launcher = getattr(config, "launcher", None)
    threads = int(getattr(launcher, "threads_per_trainer", 1))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
