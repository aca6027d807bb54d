"""Serving Qwen2-VL on SGLang's CPU engine (venv-local, see README.md).

SGLang registers the Qwen-VL family's image processor in `sglang.srt.multimodal.processors.
qwen_vl`, which imports `sglang.srt.models.qwen3_5` for its class names. On CPU that module
looks up four `torch.ops.sgl_kernel.*_cpu` ops at import time; they exist only in the compiled
CPU build of `sgl_kernel`, so the import failed, SGLang skipped the processor ("Ignore import
error") and a Qwen2-VL server died with "No processor registered for architecture".

Qwen2-VL never calls them (they are Qwen3.5's gated-attention kernels). Each name is set on the
`torch.ops.sgl_kernel` namespace as a Python function that raises naming itself; the operator
registry is untouched, so SGLang's Intel-AMX probe (`convert_weight_packed`) still finds no
kernel and stays off.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

QWEN3_5_CPU_OPS: tuple[str, ...] = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


class ShimmedCpuOpCalled(RuntimeError):
    """A CPU `sgl_kernel` op that only the compiled kernel package provides was called."""


def _raising(name: str) -> Callable[..., Any]:
    def shimmed(*args: Any, **kwargs: Any) -> Any:
        raise ShimmedCpuOpCalled(
            f"torch.ops.sgl_kernel.{name} was called, but in this CPU SGLang venv it is only a "
            "stand-in (engines/sglang/shim/areal_like_sglang_vision.py) so that SGLang's Qwen-VL "
            "processor imports. Qwen3.5 models need SGLang's compiled CPU kernels; serve "
            "Qwen2-VL / Qwen2.5-VL or a dense model here."
        )

    shimmed.__name__ = shimmed.__qualname__ = name
    return shimmed


def define_qwen3_5_cpu_op_stand_ins(_module: ModuleType | None = None) -> None:
    """Before `sglang.srt.models.qwen3_5` runs: make its import-time op lookups succeed."""
    import torch

    namespace = torch.ops.sgl_kernel
    for name in QWEN3_5_CPU_OPS:
        try:
            getattr(namespace, name)
        except AttributeError:  # not compiled in: stand in for it
            setattr(namespace, name, _raising(name))

