"""Replacing a file so that a reader sees the old text or the new one, never half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` beside `path`, then rename it over `path` (one step on POSIX)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    scratch.write_text(text)
    scratch.replace(target)
