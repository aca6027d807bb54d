"""LoRA serving on SGLang's CPU engine (`--enable-lora --lora-backend torch_native`).

SGLang's LoRA layers and its `torch_native` LoRA backend stage small index tensors in pinned
host memory (`pin_memory=True`, `.pin_memory()`) before copying them to the GPU. On a machine
without an accelerator torch has no pinned-memory allocator and raises "pin_memory=True
requires a CUDA or other accelerator backend", so a server started with `--enable-lora` dies
while it builds its LoRA modules. The tensors already live in host memory there, so pinning
them means nothing: in exactly these two modules the factory functions get the tensors without
pinning, and `Tensor.pin_memory()` of an unpinnable CPU tensor returns the tensor itself.
Everything else (adapter loading, the memory pool, the torch_native kernels) is SGLang's own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

# Installed by the hooks: which modules see the unpinned torch, and whether Tensor.pin_memory
# is already wrapped.
_PATCHED: dict[str, bool] = {}
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor")


class _UnpinnedTorch:
    """`torch`, except that its tensor factories ignore `pin_memory=True`."""

    def __init__(self, torch_module: ModuleType) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._torch, name)
        if name not in _FACTORIES:
            return attr

        def unpinned(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return attr(*args, **kwargs)

        return unpinned


def _pin_memory_is_identity() -> None:
    import torch

    if _PATCHED.get("Tensor.pin_memory") or torch.cuda.is_available():
        return
    pin_memory = torch.Tensor.pin_memory

    def pin_or_keep(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "cpu" and not torch.cuda.is_available():
            return self  # no accelerator to copy to: host memory is all there is
        return pin_memory(self, *args, **kwargs)

    torch.Tensor.pin_memory = pin_or_keep  # type: ignore[method-assign,assignment]
    _PATCHED["Tensor.pin_memory"] = True


def unpinned_lora_module(module: ModuleType) -> None:
    """Hook for `sglang.srt.lora.layers` and `sglang.srt.lora.backend.torch_backend`."""
    import torch

    if torch.cuda.is_available():
        return
    if not hasattr(module, "torch"):
        raise AttributeError(f"{module.__name__} no longer imports torch at module level: "
                             f"the LoRA pin-memory shim (areal_like_sglang_lora.py) needs updating")
    module.torch = _UnpinnedTorch(torch)  # type: ignore[attr-defined]
    _PATCHED[module.__name__] = True
    _pin_memory_is_identity()
