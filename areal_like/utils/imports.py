"""User code named in config by import path: `my_pkg.tasks:make_task`."""

from __future__ import annotations

import importlib
import multiprocessing
import os
from typing import Any

from areal_like.api.config import IMPORT_PATH


def this_process() -> str:
    rank = os.environ.get("RANK")
    return (f"process {multiprocessing.current_process().name} (pid {os.getpid()}"
            + (f", trainer rank {rank}" if rank is not None else "") + ")")


def load_object(path: str, key: str) -> Any:
    """The object at `module:attribute` (config key `key` named it); ImportError naming the
    path, the key and this process otherwise."""
    if not IMPORT_PATH.match(path):
        raise ValueError(f"{key}={path!r} is not an import path like 'my_pkg.module:function'")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{key}={path!r} cannot be imported in the {this_process()}: {e} "
                          f"(is its folder the working directory or on PYTHONPATH?)") from e
    return obj
