"""`--enable-return-routed-experts` on SGLang's CPU engine (router replay, R3).

SGLang records each token's experts in a host-side buffer that it allocates with
`pin_memory=True`; for a "cpu" device its allocator table answers with an mmap buffer
registered with `cudaHostRegister`, which asks CUDA for its runtime and, on CPU torch, kills
the scheduler at start-up ("Torch not compiled with CUDA enabled", in
`state_capturer/base.py` `BaseHostCache`). On a machine without an accelerator host memory
is all there is: the capturer module alone gets a copy of the table whose "cpu" entry makes
the same buffer without registering it. Capture, read-back and the reply's encoding stay
SGLang's own; with CUDA present nothing changes.
"""

from __future__ import annotations

import collections
from types import ModuleType
from typing import Any


def unregistered_capture_buffers(base: ModuleType) -> None:
    """Hook for `sglang.srt.state_capturer.base`."""
    import torch

    if torch.cuda.is_available():
        return
    if not hasattr(base, "ALLOC_MEMORY_FUNCS"):
        raise AttributeError(f"{base.__name__} no longer has ALLOC_MEMORY_FUNCS: the routed-"
                             f"experts shim (areal_like_sglang_moe.py) needs updating")
    from sglang.srt.mem_cache.pool_host import common

    shared = base.ALLOC_MEMORY_FUNCS

    def host_buffer(dims: Any, dtype: Any, device: Any, pin_memory: bool, allocator: Any,
                    **kwargs: Any) -> Any:
        return common.alloc_with_host_register(dims, dtype, device, False, allocator, **kwargs)

    own = collections.defaultdict(shared.default_factory, shared)
    own["cpu"] = host_buffer
    base.ALLOC_MEMORY_FUNCS = own  # type: ignore[attr-defined]  # this module's only
