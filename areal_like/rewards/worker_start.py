"""How reward worker processes start.

A worker that overran its timeout is stopped and replaced. Started with `spawn`, every
worker imports the running program again (the recipe and with it torch and transformers:
5 s idle, about 45 s on a busy machine), though a reward function needs none of it.
`forkserver` (the default) imports that once, in a single-threaded server process started
with the first worker, and forks each worker from it: a replacement runs the program's own
top-level code against modules already loaded, in well under a second.
What the server imports: the modules the program imports at its top level (read from its
source, kept only when this process has them loaded, so each is known to import) and the
reward function's module.
"""

from __future__ import annotations

import ast
import importlib.util
import multiprocessing
import multiprocessing.context
import sys
from pathlib import Path
from typing import Any, Callable, Optional

START_METHODS = ("forkserver", "spawn")


def worker_context(start_method: str, fn: Optional[Callable[..., Any]] = None
                   ) -> multiprocessing.context.BaseContext:
    """The multiprocessing context reward workers start from (see module doc)."""
    if start_method not in START_METHODS:
        raise ValueError(f"reward worker start method {start_method!r}: one of {START_METHODS}")
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # process-wide, and read only when the server starts: the first pool decides
        context.set_forkserver_preload(preload_modules(fn))
    return context


def preload_modules(fn: Optional[Callable[..., Any]] = None) -> list[str]:
    """The modules a worker would import again: the running program's top-level imports and
    `fn`'s module, each only when it is loaded here."""
    names = program_imports()
    module = getattr(fn, "__module__", None)
    if module and module not in ("__main__", "__mp_main__"):
        names.append(module)
    return [n for n in dict.fromkeys(names) if n in sys.modules]


def program_imports() -> list[str]:
    """Module names imported by the top-level statements of the `__main__` module's source
    (`import a.b`, `from a import b` as `a` and `a.b`; relative imports resolved)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return []
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    package = getattr(getattr(main, "__spec__", None), "parent", None)
    names: list[str] = []
    for node in _top_level(tree.body):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base:
                names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements that run on import: the body, and the branches of top-level `try` / `if`
    (except `if __name__ == "__main__":`)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.Try):
            out += _top_level(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
        elif isinstance(node, ast.If) and not _is_main_guard(node.test):
            out += _top_level(node.body + node.orelse)
    return out


def _is_main_guard(test: ast.expr) -> bool:
    return "__main__" in ast.unparse(test) and "__name__" in ast.unparse(test)


def _absolute(node: ast.ImportFrom, package: Optional[str]) -> Optional[str]:
    if not node.level:
        return node.module
    if not package:
        return None
    try:
        return importlib.util.resolve_name("." * node.level + (node.module or ""), package)
    except ImportError:
        return None
