"""`--enable-deterministic-inference` for SGLang's CPU engine (venv-local, see README.md).

SGLang's deterministic mode has two parts: per-request seeded sampling (`sampling_seed`, a
Gumbel-max draw hashed from seed and position, in SGLang's own sampler) and batch-invariant
kernels, so that a request's logits do not depend on what else shares its batch. On CPU the
second part is missing: SGLang's batch-invariant matmuls are Triton kernels, and its argument
check only admits GPU attention backends. The `sglang.launch_server` process imports this
module from the shim's import hooks:

- `allow_torch_native` admits `torch_native` as a deterministic backend, radix cache
  included. That backend runs attention per request, and its extend path always queries the
  full sequence, so a token's attention does not depend on the batch or on what was cached.
- `install_cpu_batch_invariant_mode` replaces the Triton registration with CPU `aten::mm` /
  `aten::addmm` kernels that are row-invariant: CPU BLAS picks its micro-kernel by the number
  of rows and only gives a row the same bits for every batch size from a few rows on, so
  matrices with fewer than `MIN_ROWS` rows are zero-padded to `MIN_ROWS` and computed as one
  `bmm` (checked bit-for-bit in tests/test_sglang_deterministic.py).
- `install_cpu_murmur_hash` gives the seeded sampler the hash it needs on CPU: SGLang calls a
  compiled `sgl_kernel` op there, which the CPU-torch venv cannot have. This is the same
  MurmurHash3 as SGLang's Triton kernel, in torch integer ops, so a seed draws the same
  tokens as on a GPU server given the same logits.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

MIN_ROWS = 8
_LIBRARIES: list[Any] = []  # keep the torch.library.Library objects alive
logger = logging.getLogger(__name__)


def allow_torch_native(choices: ModuleType) -> None:
    """Admit `torch_native` through SGLang's own extension hooks for backend choices."""
    if "torch_native" not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        choices.add_deterministic_attention_backend_choices(["torch_native"])
    if "torch_native" not in choices.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        choices.add_radix_supported_deterministic_attention_backend_choices(["torch_native"])


_MASK32 = 0xFFFFFFFF


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for x < 2**32, with no int64 overflow (c split into 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: Any, r: int) -> Any:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _murmur3_mix(h: Any, k: Any) -> Any:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK32


def murmur_hash32_cpu(seed: Any, positions: Any, col_indices: Any) -> Any:
    """SGLang's `murmur_hash32` on CPU: a (n, m) uint32 hash of (seed[i], positions[i], j)."""
    import torch

    seed = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    h = torch.zeros_like(seed)
    h = _murmur3_mix(h, seed & _MASK32)
    h = _murmur3_mix(h, (seed >> 32) & _MASK32)
    h = _murmur3_mix(h, positions.to(torch.int64) & _MASK32)[:, None]
    h = _murmur3_mix(h, col_indices.to(torch.int64)[None, :] & _MASK32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


def install_cpu_murmur_hash(murmur_hash: ModuleType) -> None:
    """Route SGLang's `murmur_hash32` to `murmur_hash32_cpu` for CPU tensors."""
    original = murmur_hash.murmur_hash32

    def murmur_hash32(seed: Any, positions: Any, col_indices: Any) -> Any:
        if seed.device.type == "cpu":
            return murmur_hash32_cpu(seed, positions, col_indices)
        return original(seed, positions, col_indices)

    murmur_hash.murmur_hash32 = murmur_hash32


def _row_invariant_mm(a: Any, b: Any) -> Any:
    import torch

    rows = a.shape[0]
    if rows < MIN_ROWS:
        a = torch.cat([a, a.new_zeros(MIN_ROWS - rows, a.shape[1])])
    # bmm is not overridden, so this reaches the BLAS kernel (no recursion into mm).
    return torch.bmm(a.unsqueeze(0), b.unsqueeze(0))[0, :rows]


def _row_invariant_addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    out = _row_invariant_mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


def _row_invariant_mm_out(a: Any, b: Any, *, out: Any) -> Any:
    result = _row_invariant_mm(a, b)
    out.resize_(result.shape)
    return out.copy_(result)


def install_cpu_batch_invariant_mode(batch_invariant_ops: ModuleType) -> None:
    """Make SGLang's `enable_batch_invariant_mode` register the CPU kernels above."""

    def enable_batch_invariant_mode(enable_bmm: bool = True) -> None:
        if _LIBRARIES:
            return
        import torch.library

        lib = torch.library.Library("aten", "IMPL")
        lib.impl("aten::mm", _row_invariant_mm, "CPU")
        lib.impl("aten::mm.out", _row_invariant_mm_out, "CPU")
        lib.impl("aten::addmm", _row_invariant_addmm, "CPU")
        _LIBRARIES.append(lib)
        logger.warning("CPU batch-invariant mode: aten::mm/addmm pad to %d rows", MIN_ROWS)

    batch_invariant_ops.enable_batch_invariant_mode = enable_batch_invariant_mode
