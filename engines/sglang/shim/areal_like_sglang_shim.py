"""Import-time fixes for SGLang's CPU engine (venv-local, see README.md).

Loaded at interpreter start by `areal_like_sglang_shim.pth` in the SGLang venv. It only
installs a `sys.meta_path` finder (cheap: torch is not imported here) that runs a hook right
after one of these modules is imported:

- `torchvision.extension`: when torchvision's C++ ops failed to load (the CUDA build cannot
  load against CPU torch), define the schemas of `torchvision::nms` and `torchvision::qnms`
  with CPU kernels that raise. torchvision's `_meta_registrations` registers fake kernels for
  exactly these two ops without checking that its C++ ops loaded, which raises "operator
  torchvision::nms does not exist" and makes `import torchvision` (and so sglang) fail.
- `sglang.srt.arg_groups.choices`, `sglang.srt.batch_invariant_ops`,
  `sglang.kernels.ops.sampling.murmur_hash` and `sglang.srt.layers.sampler` (CPU engine only):
  make `--enable-deterministic-inference` work with the `torch_native` backend, see
  `areal_like_sglang_deterministic.py`.
- `sglang.srt.entrypoints.engine` (CPU engine, `AREAL_LIKE_SGLANG_FORK=1`, set from
  `ServerConfig.fork_children`): start the scheduler and detokenizer by fork, so they
  inherit the imports instead of repeating them.
- `sglang.srt.managers.scheduler` (CPU engine): a paused scheduler (`/pause_generation`, as
  every weight update pauses the fleet) waits on its sockets like an idle one under
  `--sleep-on-idle`, instead of polling them in a busy loop that takes a whole core.
- `sglang.srt.lora.layers`, `sglang.srt.lora.backend.torch_backend` (CPU engine): LoRA
  serving without pinned memory, see `areal_like_sglang_lora.py`.
- `sglang.srt.layers.attention.torch_native_backend` (CPU engine): one SDPA call per group of
  equal-length requests instead of one per request, see `areal_like_sglang_attention.py`.

and one hook right *before* a module runs:

- `sglang.srt.models.qwen3_5` (CPU engine): stand-ins for the compiled CPU ops it looks up at
  import, so SGLang's Qwen-VL image processor registers, see `areal_like_sglang_vision.py`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

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
            "stub from engines/sglang/shim/areal_like_sglang_shim.py exists, so that "
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


def _allow_deterministic_torch_native(choices: ModuleType) -> None:
    import areal_like_sglang_deterministic

    areal_like_sglang_deterministic.allow_torch_native(choices)


def _cpu_batch_invariant_mode(batch_invariant_ops: ModuleType) -> None:
    import areal_like_sglang_deterministic

    areal_like_sglang_deterministic.install_cpu_batch_invariant_mode(batch_invariant_ops)


def _cpu_murmur_hash(murmur_hash: ModuleType) -> None:
    import areal_like_sglang_deterministic

    areal_like_sglang_deterministic.install_cpu_murmur_hash(murmur_hash)


def _fork_children(engine: Any) -> None:  # Any: a ModuleType takes no new attributes
    """Start the scheduler and detokenizer by fork instead of spawn (CPU engine only): the
    children inherit every module the server already imported instead of importing SGLang
    again, which is about half of a server's start-up on a small CPU machine. Spawn exists
    for CUDA, which cannot be used across a fork; the CPU engine never initialises it."""
    set_envs_and_config = engine._set_envs_and_config

    def set_envs_and_config_then_fork(*args: Any, **kwargs: Any) -> Any:
        result = set_envs_and_config(*args, **kwargs)
        engine.mp.set_start_method("fork", force=True)
        return result

    engine._set_envs_and_config = set_envs_and_config_then_fork


def _eager_seeded_sampling(sampler: ModuleType) -> None:
    import areal_like_sglang_deterministic

    areal_like_sglang_deterministic.install_eager_seeded_sampling(sampler)


def _unpinned_lora(module: ModuleType) -> None:
    import areal_like_sglang_lora

    areal_like_sglang_lora.unpinned_lora_module(module)


def _paused_scheduler_waits(scheduler: ModuleType) -> None:
    """SGLang's event loops `continue` at once while the engine is paused, so a paused
    scheduler spins through `ingest_requests` on a whole core for as long as a weight update
    lasts (or, for a server left paused, until it resumes): on a small CPU machine that core
    is the trainer's. With `--sleep-on-idle` the scheduler already has an `IdleSleeper`
    polling its request sockets (up to 1 s, woken by any message); a paused one with no
    request left to dispatch now waits on it too. The paused loop does nothing but take
    requests, so it answers each as soon as it arrives, as before."""
    record_paused = scheduler.Scheduler._record_scheduler_state_for_paused_engine

    def record_paused_then_wait(self: Any) -> None:
        record_paused(self)
        if not self._deferred_input_requests:
            self.maybe_sleep_on_idle()

    scheduler.Scheduler._record_scheduler_state_for_paused_engine = record_paused_then_wait


def _unregistered_capture_buffers(base: ModuleType) -> None:
    import areal_like_sglang_moe

    areal_like_sglang_moe.unregistered_capture_buffers(base)


def _grouped_attention(backend: ModuleType) -> None:
    import areal_like_sglang_attention

    areal_like_sglang_attention.install_grouped_attention(backend)


def _qwen3_5_cpu_op_stand_ins(qwen3_5: ModuleType) -> None:
    import areal_like_sglang_vision

    areal_like_sglang_vision.define_qwen3_5_cpu_op_stand_ins(qwen3_5)


_HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "torchvision.extension": define_missing_torchvision_ops,
}
_BEFORE_HOOKS: dict[str, Callable[[ModuleType], None]] = {}
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    _HOOKS["sglang.srt.arg_groups.choices"] = _allow_deterministic_torch_native
    _HOOKS["sglang.srt.batch_invariant_ops"] = _cpu_batch_invariant_mode
    _HOOKS["sglang.kernels.ops.sampling.murmur_hash"] = _cpu_murmur_hash
    if os.environ.get("AREAL_LIKE_SGLANG_COMPILED_SAMPLER") != "1":  # 1: SGLang's, to compare
        _HOOKS["sglang.srt.layers.sampler"] = _eager_seeded_sampling
    if os.environ.get("AREAL_LIKE_SGLANG_PAUSED_SPIN") != "1":  # 1: SGLang's loop, to compare
        _HOOKS["sglang.srt.managers.scheduler"] = _paused_scheduler_waits
    _HOOKS["sglang.srt.lora.layers"] = _unpinned_lora
    _HOOKS["sglang.srt.lora.backend.torch_backend"] = _unpinned_lora
    _HOOKS["sglang.srt.state_capturer.base"] = _unregistered_capture_buffers
    _HOOKS["sglang.srt.layers.attention.torch_native_backend"] = _grouped_attention
    if os.environ.get("AREAL_LIKE_SGLANG_FORK") == "1":  # ServerConfig.fork_children
        _HOOKS["sglang.srt.entrypoints.engine"] = _fork_children
    _BEFORE_HOOKS["sglang.srt.models.qwen3_5"] = _qwen3_5_cpu_op_stand_ins


def _no_hook(module: ModuleType) -> None:
    pass


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader, before: Callable[[ModuleType], None],
                 after: Callable[[ModuleType], None]) -> None:
        self._wrapped = wrapped
        self._before = before
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._before(module)
        self._wrapped.exec_module(module)
        self._after(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        before, after = _BEFORE_HOOKS.get(fullname), _HOOKS.get(fullname)
        if before is None and after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, before or _no_hook, after or _no_hook)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
