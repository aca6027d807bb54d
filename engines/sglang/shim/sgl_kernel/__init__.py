"""Import shim for `sgl_kernel` in the CPU SGLang venv (installed there only; see ../README.md).

Why: SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports the names below from `sgl_kernel`
at module level, but the only `sgl_kernel` on PyPI (`sglang-kernel`) is a CUDA build that cannot
be installed against CPU torch. For dense models (Qwen2/Llama) served with the torch_native
attention backend and no speculative decoding, SGLang imports these names but never calls them.

What it covers: exactly these eight functions (KV-cache copy, request-to-token-pool assignment,
and six speculative-decoding helpers). Each is a stub that raises a RuntimeError naming itself
when called, so a code path that does need the real kernel fails loudly instead of silently.
Any other name is missing on purpose: SGLang's own `try: import ... except ImportError`
fallbacks stay in effect.
"""

from __future__ import annotations

from typing import Any, Callable

SHIMMED_NAMES: tuple[str, ...] = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


class ShimmedKernelCalled(RuntimeError):
    """A stubbed `sgl_kernel` function was called: this SGLang setup needs the real kernel."""


def _stub(name: str) -> Callable[..., Any]:
    def shimmed(*args: Any, **kwargs: Any) -> Any:
        raise ShimmedKernelCalled(
            f"sgl_kernel.{name} was called, but in this CPU SGLang venv `sgl_kernel` is only an "
            "import shim (engines/sglang/shim/sgl_kernel). The real kernel is a CUDA build. "
            "Serve a dense model with --attention-backend torch_native and without speculative "
            "decoding, or install SGLang on a GPU machine."
        )

    shimmed.__name__ = shimmed.__qualname__ = name
    return shimmed


assign_draft_cache_locs_contiguous_cpu = _stub("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _stub("assign_extend_cache_locs_cpu")
assign_req_to_token_pool_cpu = _stub("assign_req_to_token_pool_cpu")
build_tree_kernel_efficient_cpu = _stub("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _stub("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _stub("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _stub("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _stub("verify_tree_greedy_cpu")
