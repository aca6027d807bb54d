"""A `spawn`ed child that imports the parent's program only if it needs it.

multiprocessing's `spawn` runs the parent's `__main__` again in the child before anything else
(as `__mp_main__`), so that objects the program defines can be unpickled there. For a recipe
that is the whole trainer: torch, transformers, tensordict, FSDP (~7 s of a core), in a child
(the rollout controller) that needs a fraction of it, at the moment the servers and the trainer
start on the same cores; and the child's reward workers preloaded it once more. Here the child
starts without it, and the program is imported, exactly as multiprocessing would have, the
first time something looks up a name in `__main__` (an object of the program unpickled).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParentProgram:
    """What multiprocessing would import in the child: the module name (`python -m`) or the
    script's path."""

    name: Optional[str]
    path: Optional[str]


@contextlib.contextmanager
def children_skip_the_program() -> Iterator[ParentProgram]:
    """Around `Process.start()` (spawn): multiprocessing finds no program to import in the
    child (it reads `__main__.__spec__` and `__file__` while starting it, in this thread)."""
    main = sys.modules["__main__"]
    program = ParentProgram(getattr(getattr(main, "__spec__", None), "name", None),
                            getattr(main, "__file__", None))
    saved: dict[str, Any] = {key: main.__dict__[key] for key in ("__spec__", "__file__")
                             if key in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield program
    finally:
        main.__dict__.update(saved)


def import_program_on_first_use(program: ParentProgram) -> None:
    """In the child: `__main__` imports the parent's program when a name is first looked up in
    it (pickle's lookup of a class or function the program defines)."""
    from multiprocessing import spawn

    bootstrap = sys.modules["__main__"]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):  # `__file__`, `__spec__`, ...: the bootstrap has none
            raise AttributeError(attr)
        if sys.modules["__main__"] is bootstrap:
            if program.name:
                spawn._fixup_main_from_name(program.name)  # type: ignore[attr-defined]
            elif program.path:
                spawn._fixup_main_from_path(program.path)  # type: ignore[attr-defined]
        real = sys.modules["__main__"]
        if real is bootstrap:
            raise AttributeError(f"module '__main__' has no attribute {attr!r}")
        return getattr(real, attr)

    bootstrap.__getattr__ = __getattr__  # type: ignore[method-assign]
