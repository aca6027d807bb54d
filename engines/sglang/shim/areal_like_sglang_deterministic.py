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
  MurmurHash3 as SGLang's Triton kernel, in numpy uint32 arithmetic, so a seed draws the
  same tokens as on a GPU server given the same logits.
- `install_eager_seeded_sampling` runs the seeded sampler (`multinomial_with_seed`) eagerly
  instead of through `torch.compile`, whose first call cost every new server 4-17 s.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

MIN_ROWS = 8
_LIBRARIES: list[Any] = []  # keep the torch.library.Library objects alive
logger = logging.getLogger(__name__)


# an SGLang module whose functions a hook replaces (typed loosely: type checkers run where
# SGLang is not installed, and a ModuleType takes no new attributes)
PatchedModule = Any


def allow_torch_native(choices: ModuleType) -> None:
    """Admit `torch_native` through SGLang's own extension hooks for backend choices."""
    if "torch_native" not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        choices.add_deterministic_attention_backend_choices(["torch_native"])
    if "torch_native" not in choices.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        choices.add_radix_supported_deterministic_attention_backend_choices(["torch_native"])


def _rotl32(x: Any, r: int) -> Any:
    import numpy as np

    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _murmur3_mix(h: Any, k: Any) -> Any:
    import numpy as np

    k = _rotl32(k * np.uint32(0xCC9E2D51), 15) * np.uint32(0x1B873593)
    return _rotl32(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)


def murmur_hash32_cpu(seed: Any, positions: Any, col_indices: Any) -> Any:
    """SGLang's `murmur_hash32` on CPU: a (n, m) uint32 hash of (seed[i], positions[i], j).
    In numpy uint32 arithmetic, which wraps mod 2**32 as the hash needs (a quarter of the
    time of the same hash in torch int64 ops, which must mask every product)."""
    import numpy as np
    import torch

    seed64 = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    s = seed64.numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        h = np.zeros(s.shape, np.uint32)
        h = _murmur3_mix(h, (s & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        h = _murmur3_mix(h, (s >> np.uint64(32)).astype(np.uint32))
        h = _murmur3_mix(h, positions.numpy().astype(np.uint32))[:, None]
        h = _murmur3_mix(h, col_indices.numpy().astype(np.uint32)[None, :])
        h = h ^ np.uint32(16)
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        h = h ^ (h >> np.uint32(16))
    return torch.from_numpy(h.astype(np.int64)).to(torch.uint32)


def install_cpu_murmur_hash(murmur_hash: PatchedModule) -> None:
    """Route SGLang's `murmur_hash32` to `murmur_hash32_cpu` for CPU tensors."""
    original = murmur_hash.murmur_hash32

    def murmur_hash32(seed: Any, positions: Any, col_indices: Any) -> Any:
        if seed.device.type == "cpu":
            return murmur_hash32_cpu(seed, positions, col_indices)
        return original(seed, positions, col_indices)

    murmur_hash.murmur_hash32 = murmur_hash32


def install_eager_seeded_sampling(sampler: PatchedModule) -> None:
    """Run SGLang's `multinomial_with_seed` eagerly on CPU tensors. SGLang wraps it in
    `torch.compile`, whose first call in each server process compiles it: 4-7 s with a warm
    inductor cache and 17 s on a fresh machine, paid by the first sampled request after every
    server start. Eager, with the numpy hash above, one call takes no longer than the compiled
    one (0.34 against 0.38 ms for 16 x 512) and draws the same tokens: the same float64 ops."""
    compiled = sampler.multinomial_with_seed
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:
        raise AttributeError("sglang.srt.layers.sampler.multinomial_with_seed is no longer a "
                             "torch.compile wrapper (_torchdynamo_orig_callable): update "
                             "install_eager_seeded_sampling")

    def multinomial_with_seed(logprobs: Any, seed: Any, positions: Any) -> Any:
        if logprobs.device.type == "cpu":
            return eager(logprobs, seed, positions)
        return compiled(logprobs, seed, positions)

    sampler.multinomial_with_seed = multinomial_with_seed


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


def install_cpu_batch_invariant_mode(batch_invariant_ops: PatchedModule) -> None:
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
