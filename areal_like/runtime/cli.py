"""Command-line parsing for recipes: `--config FILE` plus Hydra overrides `key=value`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, TypeVar

from areal_like.api.config_loader import ConfigError, load_config

T = TypeVar("T")
CONF_DIR = Path(__file__).resolve().parents[2] / "recipes" / "conf"


def split_args(argv: list[str], default_config: str) -> tuple[Path, list[str]]:
    """(config file, overrides) from `[--config FILE] [key=value ...]`."""
    config, overrides, args = None, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--config":
            if not args:
                raise ConfigError("--config needs a file path")
            config = args.pop(0)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}: recipes take --config FILE and key=value "
                              f"overrides")
        else:
            overrides.append(arg)
    path = Path(config) if config else CONF_DIR / default_config
    return path, overrides


def parse_recipe_args(config_cls: type[T], default_config: str,
                      argv: Optional[list[str]] = None) -> T:
    """The validated config, or exit 2 with the error naming the bad key (no traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides = split_args(argv, default_config)
        return load_config(config_cls, path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
