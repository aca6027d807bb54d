"""AReaL-lite's engine calls on ours: the rollout engine that also runs workflows, the
future-returning fleet update, upload_weights / connect_engine, and the small helpers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from areal_like.api import FinetuneSpec, InferenceEngine, WeightUpdateMeta
from areal_like.api.config import RolloutConfig
from areal_like.api.config_loader import ConfigError, load_config
from areal_like.rewards import math_verify_reward
from areal_like.rollout.controller import RolloutController
from areal_like.runtime.recipe_args import split_args
from engines.fleet.client import RemoteSGLangEngine as _SGLangClient
from engines.fsdp.engine import FSDPEngine as _FSDPEngine
from workflows.common import load_tokenizer

T = TypeVar("T")

NO_STALENESS_CONTROL_VERSION = 10**9
UPLOAD_TIMEOUT_S = 600.0  # how long a fleet update waits for the trainer's upload of its weights
_uploads: dict[str, threading.Event] = {}  # meta.path -> set once the folder is complete
_uploads_lock = threading.Lock()


def _upload_event(path: str) -> threading.Event:
    with _uploads_lock:
        return _uploads.setdefault(str(Path(path).resolve()), threading.Event())


def _forget_upload(path: str) -> None:
    with _uploads_lock:
        _uploads.pop(str(Path(path).resolve()), None)


def gsm8k_reward_fn(prompt: str, completions: str, prompt_ids: Any, completion_ids: Any,
                    answer: str, **kwargs: Any) -> float:
    """AReaL-lite's GSM8K reward, in its calling convention: 1.0 when the completion's final
    answer equals `answer` mathematically (`areal_like.rewards.math_verify_reward`)."""
    return math_verify_reward(prompt, completions, answer)


class Transformers4Tokenizer:
    """A tokenizer as AReaL-lite code (written for transformers 4) uses it: the same object,
    except that `apply_chat_template(..., tokenize=True)` returns the token ids, not the
    dict transformers >= 5 returns by default. Picklable, as workflows holding it travel to
    the rollout controller's process."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, return_dict: bool = False, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **{**kwargs, "return_dict": return_dict})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # while unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def load_hf_tokenizer(path: str) -> Transformers4Tokenizer:
    return Transformers4Tokenizer(load_tokenizer(path))


def load_expr_config(args: list[str], config_cls: type[T]) -> tuple[T, str]:
    """(config, its file) from `--config FILE key=value ...`, as AReaL-lite's function."""
    path, overrides = split_args(list(args), "")
    if not str(path):
        raise ConfigError("load_expr_config: give --config FILE")
    return load_config(config_cls, path, overrides), str(path)


class RemoteSGLangEngine(RolloutController):
    """AReaL-lite's rollout engine: the client of an SGLang fleet that also runs workflows
    (`rollout_batch`, `prepare_batch`, `submit`/`wait`). Here that is a `RolloutController`
    over our HTTP client."""

    def __init__(self, config: RolloutConfig) -> None:
        config = dataclasses.replace(  # its own: set_version may lift its bound
            config, staleness=dataclasses.replace(config.staleness))
        super().__init__(config, _SGLangClient(config))

    def set_version(self, version: int) -> None:
        """As ours; and AReaL-lite's idiom for an evaluation engine, a version of 1e9 or more
        ("no off-policyness control"), lifts this engine's staleness bound: our tokens carry
        the servers' versions, which such a version would otherwise make all stale."""
        if version >= NO_STALENESS_CONTROL_VERSION:
            self.config.staleness.max_head_offpolicyness = NO_STALENESS_CONTROL_VERSION * 1000
        super().set_version(version)

    def pause(self) -> None:
        """AReaL-lite's meaning: stop submitting new rollouts. The servers keep serving (an
        evaluation engine beside this one goes on); a weight update pauses them itself."""
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()

    # AReaL-lite's signature (addr, ft_spec), not our engine's
    def initialize(self, addr: Optional[str] = None,  # type: ignore[override]
                   ft_spec: Optional[FinetuneSpec] = None) -> None:
        if addr is not None:
            raise ValueError(f"RemoteSGLangEngine.initialize(addr={addr!r}): the servers are "
                             f"RolloutConfig.server_addrs; pass None")
        super().initialize()

    def load_weights(self, meta: WeightUpdateMeta) -> None:
        """Load the written folder `meta.path` on the fleet now (blocks), as the version after
        the current one."""
        RolloutController.update_weights(
            self, dataclasses.replace(meta, version=self.get_version() + 1))

    # AReaL-lite's call returns a future the caller waits on; ours blocks
    def update_weights(self, meta: WeightUpdateMeta  # type: ignore[override]
                       ) -> concurrent.futures.Future[None]:
        """Start loading `meta` on the fleet once the trainer's `upload_weights(meta)` has
        written it (AReaL-lite's order: this first, then the upload, then `.result()`). As in
        AReaL-lite, the new weights are the version after the current one (`set_version`
        follows the update), whatever `meta.version` says."""
        if meta.type != "disk":
            raise ValueError(f"RemoteSGLangEngine.update_weights: WeightUpdateMeta.type="
                             f"{meta.type!r}; this AReaL-lite call supports 'disk' (the "
                             f"distributed transport: FSDPEngine.connect_engine)")
        path = meta.path
        if path is None:
            raise ValueError("RemoteSGLangEngine.update_weights: WeightUpdateMeta.path is None; "
                             "the disk transport needs the folder upload_weights writes")
        uploaded = _upload_event(path)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-update")

        def load_when_uploaded() -> None:
            if not uploaded.wait(UPLOAD_TIMEOUT_S):
                raise TimeoutError(f"no upload_weights of {path} within {UPLOAD_TIMEOUT_S} s")
            _forget_upload(path)
            self.load_weights(meta)

        future = pool.submit(load_when_uploaded)
        pool.shutdown(wait=False)
        return future


class FSDPEngine(_FSDPEngine):
    """Our FSDP engine with AReaL-lite's weight calls: `upload_weights` (export only; a
    `RemoteSGLangEngine.update_weights` future loads it) and `connect_engine` (after which
    `update_weights` does the whole update: export, load on the fleet, version)."""

    _rollout: Optional[InferenceEngine] = None

    def upload_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        stats = _FSDPEngine.update_weights(self, meta)
        if self.rank == 0 and meta.path is not None:  # what update_weights waits for
            _upload_event(meta.path).set()
        return stats

    def connect_engine(self, rollout: InferenceEngine, meta: WeightUpdateMeta) -> None:
        if meta.type != "disk":
            raise ValueError(f"connect_engine: WeightUpdateMeta.type={meta.type!r}; ported "
                             f"scripts use 'disk' (the distributed transport: "
                             f"rollout.weights.transport=distributed in our recipes)")
        self._rollout = rollout
        if self.lora_enabled:  # the servers hold the base only: serve the initial adapter
            adapter = self.adapter_weights()
            if adapter is not None:
                initial = WeightUpdateMeta.from_adapter(adapter, self.get_version())
                if isinstance(rollout, RemoteSGLangEngine):  # (its own call: a future)
                    RolloutController.update_weights(rollout, initial)
                else:
                    rollout.update_weights(initial)
            if dist.is_initialized():
                dist.barrier()

    def update_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        if self._rollout is None:  # not connected: our meaning, export only
            return _FSDPEngine.update_weights(self, meta)
        stats = _FSDPEngine.update_weights(self, meta)
        if self.rank == 0:  # pause (retract) -> load -> label -> continue
            if isinstance(self._rollout, RemoteSGLangEngine):  # its update_weights: a future
                self._rollout.load_weights(meta)
            else:
                self._rollout.update_weights(meta)
        if dist.is_initialized():
            dist.barrier()
        return stats
