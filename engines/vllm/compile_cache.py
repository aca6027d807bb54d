"""vLLM's cache (`VLLM_CACHE_ROOT`, ~/.cache/vllm: torch.compile artifacts among others) shared
by every start, without letting a start that is killed mid-compile break the next one.

vLLM writes its compiled artifacts into the cache as it compiles; a start killed meanwhile
leaves a truncated one, which the next start of that model loads and fails on. So each start
gets a cache of its own, seeded from the shared one (hard links: nothing is copied, nothing
shared is written), and what it added is linked into the shared cache only once the server
answers /health — each new entry whole, by one rename — so the shared cache only ever holds the
entries of starts that finished. A server's own cache goes when it stops (it may read it while
it runs); a start that dies leaves nothing in the shared one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path


def shared_cache(env: dict[str, str]) -> Path:
    return Path(env.get("VLLM_CACHE_ROOT") or "~/.cache/vllm").expanduser()


def private_cache(shared: Path) -> Path:
    """A new cache for one start, holding (as links) what the shared one holds; beside it,
    so that links and the renames of `publish` stay on one file system."""
    shared.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{shared.name}-start-", dir=shared.parent))
    if shared.is_dir():
        shutil.copytree(shared, private, symlinks=True, dirs_exist_ok=True,
                        copy_function=_link_or_copy, ignore=_partial)
    return private


def publish(private: Path, shared: Path) -> list[Path]:
    """Link what a finished start added into the shared cache (each new file or folder by one
    rename, so a reader sees it whole or not at all). Returns the entries added."""
    added: list[Path] = []
    _merge(private, shared, added)
    return added


def _merge(source: Path, target: Path, added: list[Path]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        destination = target / entry.name
        if destination.is_dir() and entry.is_dir() and not entry.is_symlink():
            _merge(entry, destination, added)
        elif not destination.exists() and not destination.is_symlink():
            staging = target / f".{entry.name}.{uuid.uuid4().hex}.partial"
            try:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, staging, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(str(entry), str(staging))
                os.replace(staging, destination)
            finally:
                if staging.is_dir():
                    shutil.rmtree(staging, ignore_errors=True)
                elif staging.exists():
                    staging.unlink()
            added.append(destination)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _partial(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".partial")]  # another publish under way


def discard(private: Path) -> None:
    """A server's own cache, once it stopped (a start that did not finish: perhaps with a
    truncated artifact, which never reached the shared cache)."""
    shutil.rmtree(private, ignore_errors=True)
