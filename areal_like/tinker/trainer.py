"""The Tinker API's training models on our FSDP2 engine: one `FSDPEngine` (base + PEFT LoRA
adapter, AdamW) per model id, on every trainer rank. Each call here is collective: every rank
makes the same calls in the same order (`areal_like.tinker.ranks` sees to it); data-parallel
ranks each take their share of a forward_backward's datums, rank 0 returns the results."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal_like.api.lora_config import LoRAConfig
from areal_like.tinker import losses
from areal_like.tinker.errors import NotFound, UserError
from areal_like.tinker.lora_shape import LORA_ALPHA, LoRAShape
from areal_like.tinker.wire import Datum
from engines.fsdp.dist import all_reduce_scalar
from engines.fsdp.engine import FSDPEngine

logger = logging.getLogger(__name__)

class TinkerTrainer:
    """Models by id, each an FSDP2 LoRA engine over the one base model this server trains."""

    def __init__(self, base_path: str, max_tokens_per_mb: int = 4096) -> None:
        self.base_path = base_path
        self.max_tokens_per_mb = max_tokens_per_mb
        self.engines: dict[str, FSDPEngine] = {}
        self.steps: dict[str, int] = {}  # optimizer steps taken, per model
        self.vocab_size = 0

    # ---- models -----------------------------------------------------------------------
    def create(self, model_id: str, lora: LoRAShape) -> None:
        if model_id in self.engines:
            raise UserError(f"model {model_id!r} exists already")
        config = TrainEngineConfig(
            model=ModelConfig(path=self.base_path),
            optimizer=OptimizerConfig(lr=1e-4, gradient_clipping=0.0),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=self.max_tokens_per_mb),
            lora=LoRAConfig(rank=lora.rank, alpha=LORA_ALPHA,
                            target_modules=lora.target_modules))
        engine = FSDPEngine(config, section=f"tinker model {model_id}")
        engine.initialize()
        self.vocab_size = int(engine.model.get_base_model().config.vocab_size)
        self.engines[model_id] = engine
        self.steps[model_id] = 0

    def drop(self, model_id: str) -> None:
        engine = self.engines.pop(model_id, None)
        self.steps.pop(model_id, None)
        if engine is not None:
            engine.destroy()

    def _engine(self, model_id: str) -> FSDPEngine:
        engine = self.engines.get(model_id)
        if engine is None:
            raise NotFound(f"model {model_id!r} is not loaded on the trainer")
        return engine

    # ---- forward / forward_backward -----------------------------------------------------
    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str,
                         config: dict[str, float], forward_only: bool
                         ) -> Optional[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        """Per datum {logprobs, elementwise_loss} [N] and the metrics (rank 0; None
        elsewhere). Without `forward_only` the gradients add to those held until optim_step."""
        engine = self._engine(model_id)
        mine = list(range(engine.data_parallel_rank, len(data), engine.data_parallel_size))
        batch = build_batch([data[i] for i in mine], loss_fn)
        outputs_hook = losses.packed_outputs(loss_fn, config)
        if forward_only:
            # (a rank without datums runs dummy micro-batches: FSDP's collectives everywhere)
            rows = engine.forward(batch, post_hook=outputs_hook, aggregate_fn=list)
            local = sum(float(r[:, 1].double().sum()) for r in rows)
            total = all_reduce_scalar(local, engine.device, "sum",
                                      engine.mesh.dp_group if engine.mesh else None)
        else:
            try:
                total, rows = engine.accumulate_gradients(
                    batch, losses.packed_loss(loss_fn, config), outputs_hook)
            except BaseException:  # no half of a batch's gradients left for optim_step
                assert engine.optimizer is not None
                engine.optimizer.zero_grad(set_to_none=True)
                raise
        gathered = _gather_to_rank0(list(zip(mine, [r.numpy() for r in rows], strict=True)))
        if gathered is None:
            return None
        by_index = dict(gathered)
        outputs = [{"logprobs": by_index[i][:, 0], "elementwise_loss": by_index[i][:, 1]}
                   for i in range(len(data))]
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        engine = self._engine(model_id)
        assert engine.optimizer is not None
        for group in engine.optimizer.param_groups:
            group["lr"] = adam["learning_rate"]
            group["betas"] = (adam["beta1"], adam["beta2"])
            group["eps"] = adam["eps"]
            group["weight_decay"] = adam["weight_decay"]
        stats = engine.apply_gradients(max_grad_norm=adam["grad_clip_norm"])
        if stats["update_successful"]:
            self.steps[model_id] += 1
            engine.set_version(self.steps[model_id])
        return {"grad_norm:mean": stats["grad_norm"],
                "update_successful:mean": stats["update_successful"]}

    # ---- checkpoints ----------------------------------------------------------------------
    def save_state(self, model_id: str, path: str, with_optimizer: bool = True) -> int:
        """Adapter, optimizer state and step count (a DCP checkpoint), and the adapter as a
        PEFT folder beside it (`adapter/`, what HF + PEFT load). Returns the step count."""
        engine = self._engine(model_id)
        engine.save(SaveLoadMeta(path=os.path.join(path, "dcp"), weight_format="dcp",
                                 with_optim=with_optimizer))
        return self.save_adapter(model_id, os.path.join(path, "adapter"))

    def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        engine = self._engine(model_id)
        engine.load(SaveLoadMeta(path=os.path.join(path, "dcp"), weight_format="dcp",
                                 with_optim=with_optimizer))
        self.steps[model_id] = engine.get_version()

    def save_adapter(self, model_id: str, path: str) -> int:
        """The current adapter as a PEFT folder (what the servers load to sample from it).
        Returns the optimizer steps it has taken."""
        engine = self._engine(model_id)
        engine.update_weights(WeightUpdateMeta(type="disk", path=path,
                                               version=engine.get_version()))
        return self.steps[model_id]


def build_batch(data: list[Datum], loss_fn: str) -> TensorDict:
    """Padded [B, L] rows of `data` with the loss's inputs under our batch keys (a missing
    `weights` is all ones, as the SDK's cross-entropy default)."""
    if not data:
        return TensorDict({"input_ids": torch.zeros(0, 1, dtype=torch.long),
                           "attention_mask": torch.zeros(0, 1, dtype=torch.long)},
                          batch_size=[0])
    spec = losses.LOSSES[loss_fn]
    length = max(len(d.tokens) for d in data)
    n = len(data)
    out: dict[str, torch.Tensor] = {
        "input_ids": torch.zeros(n, length, dtype=torch.long),
        "attention_mask": torch.zeros(n, length, dtype=torch.long)}
    keys = ("target_tokens", *spec.inputs)
    for key in keys:
        dtype = torch.long if key == "target_tokens" else torch.float32
        out[losses.INPUT_KEYS[key]] = torch.zeros(n, length, dtype=dtype)
    for row, datum in enumerate(data):
        size = len(datum.tokens)
        out["input_ids"][row, :size] = torch.from_numpy(datum.tokens)
        out["attention_mask"][row, :size] = 1
        for key in keys:
            value = datum.inputs.get(key)
            if value is None and key == "weights":
                value = np.ones(size, dtype=np.float32)
            out[losses.INPUT_KEYS[key]][row, :size] = torch.from_numpy(np.array(value))
    return TensorDict(out, batch_size=[n])


def check_data(data: list[Datum], loss_fn: str, vocab_size: int, max_tokens: int) -> None:
    """Every datum fits a micro-batch and has the loss's inputs, each one value per token,
    targets in the vocabulary (a UserError naming the datum and input otherwise)."""
    spec = losses.LOSSES[loss_fn]
    if not data:
        raise UserError("forward_backward with no datums")
    for i, datum in enumerate(data):
        size = len(datum.tokens)
        if size > max_tokens:
            raise UserError(f"datum {i} has {size} tokens; the trainer's micro-batches hold "
                            f"{max_tokens} (tinker-serve --max-tokens-per-mb)")
        if int(datum.tokens.min()) < 0 or int(datum.tokens.max()) >= vocab_size:
            raise UserError(f"datum {i}: model_input has a token id outside the vocabulary "
                            f"[0, {vocab_size})")
        for key in ("target_tokens", *spec.inputs):
            value = datum.inputs.get(key)
            if value is None:
                if key == "weights":
                    continue
                raise UserError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
            if value.shape != (size,):
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape "
                                f"{list(value.shape)}; expected [{size}] (one per model_input "
                                f"token)")
            if not np.isfinite(value).all():
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] is not finite everywhere")
        targets = datum.inputs["target_tokens"]
        if int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
            raise UserError(f"datum {i}: target_tokens has an id outside the vocabulary "
                            f"[0, {vocab_size})")


def _gather_to_rank0(items: list[Any]) -> Optional[list[Any]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    parts: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 \
        else None
    dist.gather_object(items, parts, dst=0)
    if parts is None:
        return None
    return [item for part in parts for item in part]
