"""Import-time fix for PyPI's CUDA torchvision on CPU torch (venv-local, see README.md).

Loaded at interpreter start by `areal_like_sglang_shim.pth` in the SGLang venv. It only
installs a `sys.meta_path` finder (cheap: torch is not imported here). When
`torchvision.extension` is imported and torchvision's C++ ops failed to load (the CUDA build
cannot load against CPU torch), it defines the schemas of `torchvision::nms` and
`torchvision::qnms` with CPU kernels that raise. torchvision's `_meta_registrations` registers
fake kernels for exactly these two ops without checking that its C++ ops loaded, which raises
"operator torchvision::nms does not exist" and makes `import torchvision` (and so sglang) fail.
Every other torchvision op is already guarded by torchvision itself (`_assert_has_ops`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

_TARGET = "torchvision.extension"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list[Any] = []  # keep the torch.library.Library objects alive


def _shimmed_op(name: str) -> Any:
    def raise_not_available(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"torchvision::{name} was called, but torchvision's C++ ops are not available in "
            "this CPU SGLang venv (PyPI ships a CUDA torchvision build). Only an op schema "
            "stub from engines/sglang_shim/areal_like_sglang_shim.py exists, so that "
            "`import torchvision` works; text-only serving never calls it."
        )

    return raise_not_available


def define_missing_torchvision_ops(extension: ModuleType) -> None:
    """Give nms/qnms a schema (and a raising CPU kernel) when torchvision's _C did not load."""
    if extension._has_ops():
        return
    import torch.library

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _shimmed_op(name), "CPU")
    _LIBRARIES.append(lib)


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        define_missing_torchvision_ops(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
