"""FSDPEngine in one plain process (a one-rank gloo group): input checks and edge cases.
The multi-rank behaviour is covered under torchrun in test_fsdp_engine.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from areal_like.api import WeightUpdateMeta
from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
from engines import FSDPEngine


def _config(model_dir: Path, **mb: int) -> TrainEngineConfig:
    return TrainEngineConfig(model=ModelConfig(path=str(model_dir)),
                             optimizer=OptimizerConfig(lr=1e-3),
                             mb_spec=MicroBatchSpec(**mb))


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[FSDPEngine]:
    eng = FSDPEngine(_config(tiny_model_dir, max_tokens_per_mb=16, n_mbs=3))
    eng.initialize()
    yield eng
    eng.destroy()


def _batch(loss_rows: list[bool]) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (len(loss_rows), 10), generator=gen)
    attn = torch.ones_like(ids)
    loss_mask = torch.tensor(loss_rows)[:, None].long().expand(-1, 10).clone()
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
                      batch_size=[len(loss_rows)])


def _mask(mb: TensorDict) -> torch.Tensor:
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()


def mean_nll(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    m = _mask(mb)
    return -(next_token_logprobs(logits, mb) * m).sum() / m.sum()  # 0/0 = NaN when m is empty


def test_zero_weight_micro_batch_does_not_poison_the_step(engine: FSDPEngine) -> None:
    # three rows of 10 tokens under a 16-token budget: one row per micro-batch, one row with
    # no loss tokens (its mean_nll would be NaN)
    stats = engine.train_batch(_batch([True, False, True]), mean_nll,
                               lambda mb: _mask(mb).sum())
    assert stats["update_successful"] == 1.0
    assert math.isfinite(stats["loss"]) and stats["n_mbs"] == 3.0 and stats["n_tokens"] == 30.0


def test_bad_usage_gets_clear_errors(engine: FSDPEngine, tiny_model_dir: Path) -> None:
    batch = _batch([True, True])
    with pytest.raises(ValueError, match="total weight of 0"):
        engine.train_batch(batch, mean_nll, lambda mb: 0.0)
    with pytest.raises(ValueError, match="weights must be finite"):
        engine.train_batch(batch, mean_nll, lambda mb: float("nan"))
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        engine.train_batch(batch, lambda lg, mb: lg.sum(-1), lambda mb: 1.0)
    with pytest.raises(ValueError, match=r"post_hook must return a per-token tensor \[T=10"):
        engine.forward(batch, post_hook=lambda lg, mb: lg.sum())
    long_row = TensorDict({"input_ids": torch.ones(1, 20, dtype=torch.long),
                           "attention_mask": torch.ones(1, 20, dtype=torch.long)}, batch_size=[1])
    with pytest.raises(ValueError, match="max_tokens_per_mb=16"):
        engine.forward(long_row)
    with pytest.raises(ValueError, match="source model folder"):
        engine.update_weights(WeightUpdateMeta.from_disk(str(tiny_model_dir), 1))
    with pytest.raises(RuntimeError, match="not initialized"):
        FSDPEngine(_config(tiny_model_dir)).forward(batch)
    with pytest.raises(ValueError, match="model.path is empty"):
        FSDPEngine(TrainEngineConfig()).initialize()


def test_lr_schedule_needs_total_steps(tiny_model_dir: Path) -> None:
    cfg = _config(tiny_model_dir)
    cfg.optimizer = OptimizerConfig(lr_scheduler_type="cosine")
    eng = FSDPEngine(cfg)
    with pytest.raises(ValueError, match="total_train_steps > 0"):
        eng.initialize()
    eng.destroy()


def test_memory_settings_a_cpu_trainer_cannot_honour_are_refused(tiny_model_dir: Path) -> None:
    """Offloading moves device memory to the host: on this CPU there is none to move, and the
    setting is refused (named) rather than ignored."""
    for key in ("cpu_offload", "activation_offload"):
        cfg = _config(tiny_model_dir)
        cfg.gradient_checkpointing = True  # (activation_offload tunes checkpointed layers)
        setattr(cfg, key, True)
        eng = FSDPEngine(cfg)
        with pytest.raises(ValueError, match=f"actor.{key}=true on a cpu trainer"):
            eng.initialize()
        eng.destroy()
    for key, value in (("activation_offload", True), ("gradient_checkpointing_every", 2)):
        with pytest.raises(ValueError, match=f"TrainEngineConfig.{key}={value} is invalid: "
                                             f"expected unset without gradient_checkpointing"):
            TrainEngineConfig(**{key: value})


def test_ulysses_runs_the_inner_attention_under_its_own_name(tiny_model_dir: Path) -> None:
    """transformers' flash-attn wrapper picks its kernel by `module.config._attn_implementation`,
    which on a model loaded for Ulysses names Ulysses: the inner attention must see its own name
    there (the module's own config untouched). A one-rank group: the exchanges are identities."""
    import torch.distributed as dist
    from transformers import AttentionInterface, AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    from areal_like.utils.distributed import ensure_process_group
    from engines.fsdp.ulysses import ULYSSES_ATTENTION, SequenceShard, ulysses_attention

    seen = []

    def inner(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        seen.append((module.config._attn_implementation, module.layer_idx, tuple(k.shape)))
        return q.transpose(1, 2), None

    AttentionInterface.register("recording_inner", inner)
    owned = ensure_process_group("gloo", torch.device("cpu"))
    try:
        config = AutoConfig.from_pretrained(tiny_model_dir)
        config._attn_implementation = ULYSSES_ATTENTION
        module = Qwen2Attention(config, 2)
        shard = SequenceShard(dist.group.WORLD, 0, 1, "recording_inner", 6, 6)
        q, k, v = torch.randn(1, 4, 6, 32), torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)
        out, _ = ulysses_attention(module, q, k, v, None, sequence_shard=shard)
    finally:
        if owned:
            dist.destroy_process_group()
    assert seen == [("recording_inner", 2, (1, 2, 6, 32))]
    assert module.config._attn_implementation == ULYSSES_ATTENTION
    torch.testing.assert_close(out, q.transpose(1, 2))
