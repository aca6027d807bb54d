"""FSDP2 train engine: packed micro-batches, forward / train_batch, checkpoints, weight export.

Start every rank under `torchrun` (any world size; a plain single process also works and gets
a one-rank group). CPU uses gloo, CUDA uses NCCL (`TrainEngineConfig.backend="auto"`).

Data-parallel convention: **every data-parallel rank passes its own local shard** of the global
batch (any sizes, even empty; the ranks of one sequence- or tensor-parallel group the same rows:
`engines/fsdp/mesh.py`). `shard_batch(full_batch, engine.data_parallel_rank,
engine.data_parallel_size, group_size)` picks it. Losses are one global weighted mean:

    loss = sum_{ranks r, micro-batches m} w_rm * loss_fn(logits_rm, mb_rm) / sum_{r, m} w_rm,
    w_rm = loss_weight_fn(mb_rm)   (finite, >= 0; a micro-batch with w = 0 skips loss_fn)

so the update does not depend on how the batch was split into ranks or micro-batches.

Micro-batches: each rank counts the micro-batches first-fit-decreasing packing needs under
`mb_spec.max_tokens_per_mb` tokens (at least `mb_spec.n_mbs`); ranks agree on the maximum count
(FSDP collectives need the same number of forwards everywhere), then each rank spreads its rows
over that many micro-batches, balanced by tokens within the budget. A rank with fewer rows than
micro-batches runs dummy one-token micro-batches that contribute zero gradient.

`loss_fn(logits, mb)` and `post_hook(logits, mb)` get `logits` [T, V] for the packed tokens
(critic: values [T]) and the packed micro-batch (see `engines.fsdp.packing`): per-token keys
[T], per-sequence keys [n_seqs], `cu_seqlens`, `position_ids`. For next-token quantities use
`areal_like.utils.packed_logprobs` (label of token t = token t+1 of the same sequence).
`train_batch` does not step the LR scheduler: call `step_lr_scheduler()` once per global step.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.optim.lr_scheduler import LambdaLR

from areal_like.api.config import TrainEngineConfig
from areal_like.api.engine_api import LossFn, LossWeightFn, TrainEngine
from areal_like.api.io_struct import (
    AdapterWeights,
    FinetuneSpec,
    ParamSpec,
    SaveLoadMeta,
    WeightUpdateMeta,
)
from areal_like.utils import stats_tracker
from areal_like.utils.distributed import set_data_parallel_group
from areal_like.utils.packed_logprobs import next_token_logprobs
from areal_like.utils.quiet import silence_library_progress_bars
from engines.fsdp import lora as lora_io
from engines.fsdp import mesh as trainer_mesh
from engines.fsdp import model_io as ckpt
from engines.fsdp import moe
from engines.fsdp.attention import PACKED_SDPA, choose_attn_implementation
from engines.fsdp.backward import (
    OutputsHook,
    backward_micro_batches,
    keep_per_row,
    optimizer_step,
    scalar_loss,
)
from engines.fsdp.dist import all_reduce_scalar, ensure_process_group, resolve_device_and_backend
from engines.fsdp.optim import build_optimizer, build_scheduler
from engines.fsdp.packed_forward import PackedForward
from engines.fsdp.packing import (
    count_micro_batches,
    loss_group_units,
    pack_sequences,
    partition_into_micro_batches,
    sequence_lengths,
    unpack_to_padded,
)
from engines.fsdp.sharding import (
    DTYPES,
    apply_tensor_parallel,
    check_memory_options,
    enable_activation_checkpointing,
    shard_model,
)
from engines.fsdp.shared_prefix import PrefixTreeUse, prefix_trees, why_not_shared
from engines.fsdp.ulysses import ULYSSES_ATTENTION
from engines.fsdp.vision import freeze_vision_tower, is_vision_language, require_vision_language

logger = logging.getLogger(__name__)

PostHook = Callable[[torch.Tensor, TensorDict], torch.Tensor]


class FSDPEngine(TrainEngine):
    """An HF model (causal LM, or a value model when `config.model.is_critic`) sharded with
    FSDP2, trained with AdamW on packed micro-batches. See the module docstring."""

    def __init__(self, config: TrainEngineConfig, section: str = "") -> None:
        """`section`: the config key the errors name (default: critic or actor)."""
        self.config = config
        self.section = section or ("critic" if config.model.is_critic else "actor")
        self.model: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.lr_scheduler: Optional[LambdaLR] = None
        self.device = torch.device("cpu")
        self.rank, self.world_size = 0, 1
        self._owns_group = False
        self._version = 0
        self._pad_token_id = 0
        self._vision_language = False  # images in micro-batches (engines/fsdp/vision.py)
        self._served: Optional[list[ckpt.ServedPiece]] = None
        self._routers: Optional[moe.RouterControl] = None  # a mixture of experts' (moe.py)
        self._trees: Optional[PrefixTreeUse] = None  # actor.shared_prefix (shared_prefix.py)
        self.mesh: Optional[trainer_mesh.TrainerMesh] = None  # data x sequence x tensor (mesh.py)
        self._dcp = ckpt.DcpWrites(config.collective_timeout)  # checkpoints being written
        self._forward: Any = None  # PackedForward: a micro-batch through the model

    # ------------------------------------------------------------------ set-up
    def initialize(self, addr: Optional[str] = None,
                   ft_spec: Optional[FinetuneSpec] = None) -> None:
        cfg = self.config
        if addr is not None:
            raise ValueError(f"FSDPEngine.initialize(addr={addr!r}): the process group comes "
                             f"from the launcher's environment (torchrun / Ray); pass None")
        total_steps = ft_spec.total_train_steps if ft_spec is not None else cfg.total_train_steps
        if ft_spec is not None and cfg.total_train_steps not in (0, total_steps):
            logger.info("LR schedule over FinetuneSpec's %d steps (not actor.total_train_steps="
                        "%d)", total_steps, cfg.total_train_steps)
        if not cfg.model.path:
            raise ValueError("TrainEngineConfig.model.path is empty: set it to an HF model folder")
        if cfg.freeze_vision_tower:  # before the process group exists: nothing to tear down
            require_vision_language(cfg.model.path, "TrainEngineConfig.freeze_vision_tower")
        silence_library_progress_bars()  # no "Writing model shards" bar on every export
        self.device, backend = resolve_device_and_backend(cfg.backend)
        self._owns_group = ensure_process_group(backend, self.device,
                                                self.config.collective_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        section = self.section
        check_memory_options(cfg, self.device, section)
        self.mesh = trainer_mesh.build_trainer_mesh(cfg.parallel, self.device.type, section)
        sp = self.mesh.sp_size
        set_data_parallel_group(self.mesh.dp_group)  # process-wide: batch statistics pool on it
        stats_tracker.set_records_duplicated(not self.mesh.leads_its_rows)
        attn = choose_attn_implementation(self.device)  # (Ulysses runs it on whole rows)
        model: Any = ckpt.load_hf_model(cfg.model.path, cfg.model.is_critic,
                                        DTYPES[cfg.model.dtype],
                                        ULYSSES_ATTENTION if sp > 1 else attn)
        self._pad_token_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self._vision_language = is_vision_language(model.config)
        trainer_mesh.check_model_fits_mesh(cfg.parallel, model.config, cfg.model.path, section,
                                           cfg.lora.rank)
        if cfg.freeze_vision_tower:
            frozen = freeze_vision_tower(model)
            logger.info("vision tower frozen: %d parameters take no gradient", frozen)
        self._routers = moe.router_control(model, cfg.moe, cfg.lora.enabled,
                                           cfg.model.path)
        self._trees = prefix_trees(cfg.shared_prefix, why_not_shared(
            self._vision_language, cfg.moe.router_replay, attn, PACKED_SDPA, sp))
        if cfg.lora.enabled:
            if cfg.model.is_critic:
                raise ValueError("TrainEngineConfig.lora.rank > 0 on a critic: the value head "
                                 "must train; use LoRA on the actor only")
            model = lora_io.apply_lora(model, cfg.lora, cfg.model.path)  # base frozen
        enable_activation_checkpointing(model, cfg)
        if self.device.type == "cuda":
            torch.nn.Module.to(model, self.device)  # (HF types `to` for dtypes only)
        if self.mesh.tp_size > 1:
            apply_tensor_parallel(model, self.mesh, cfg.model.path, section)
        shard_model(model, self.mesh, cfg, self.device)
        self.model = model
        self._forward = PackedForward(
            model, self.device, is_critic=cfg.model.is_critic,
            pad_token_id=self._pad_token_id, vision_language=self._vision_language,
            routers=self._routers, router_replay=cfg.moe.router_replay, trees=self._trees,
            sequence_group=self.mesh.sp_group if sp > 1 else None, inner_attn=attn)

        self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad],
                                         cfg.optimizer)
        self.lr_scheduler = build_scheduler(self.optimizer, cfg.optimizer, total_steps)

    @property
    def data_parallel_rank(self) -> int:
        """Which rows of a batch this rank trains: ranks of one sequence-parallel group pass
        the same local batch (`shard_batch(batch, data_parallel_rank, data_parallel_size)`)."""
        return self.mesh.dp_rank if self.mesh is not None else self.rank

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.dp_size if self.mesh is not None else self.world_size

    @property
    def _fsdp_size(self) -> int:
        return self.mesh.fsdp.size() if self.mesh is not None else self.world_size

    def _dp_sum(self, value: float) -> float:
        """Summed over distinct data (a sequence-parallel group's ranks hold the same rows)."""
        return all_reduce_scalar(value, self.device, "sum",
                                 self.mesh.dp_group if self.mesh is not None else None)

    def destroy(self) -> None:
        self._dcp.wait()
        self.model = self.optimizer = self.lr_scheduler = self._forward = None
        if self._owns_group and dist.is_initialized():  # its mesh's groups die with it
            set_data_parallel_group(None)
            stats_tracker.set_records_duplicated(False)
            dist.destroy_process_group()
        self._owns_group = False

    def _require_initialized(self) -> tuple[torch.optim.Optimizer, LambdaLR]:
        """The optimizer and its scheduler (RuntimeError before initialize())."""
        if self.model is None or self.optimizer is None or self.lr_scheduler is None:
            raise RuntimeError("FSDPEngine is not initialized: call initialize() first")
        return self.optimizer, self.lr_scheduler

    def train(self, mode: bool = True) -> FSDPEngine:
        self._require_initialized()
        self.model.train(mode)
        return self

    # ------------------------------------------------------------------ micro-batches
    def _split(self, batch: TensorDict) -> tuple[list[list[int]], list[Optional[TensorDict]]]:
        """(row indices, packed micro-batch) per micro-batch of this rank, as many as on every
        other rank; a micro-batch without rows is None (run as a dummy)."""
        if not isinstance(batch, TensorDict):
            raise TypeError(f"batch must be a TensorDict, got {type(batch).__name__}")
        spec = self.config.mb_spec
        if self._trees is not None:
            self._trees.forwarded = 0  # the model's input rows over this call's micro-batches
        lengths = sequence_lengths(batch["attention_mask"]).tolist() if batch.numel() else []
        if self.mesh is not None and self.mesh.sp_size * self.mesh.tp_size > 1:
            trainer_mesh.check_same_rows(self.mesh, lengths)
        empty = [i for i, n in enumerate(lengths) if n == 0]
        if empty:
            raise ValueError(f"batch row {empty[0]} has no real tokens (attention_mask all 0)")
        units = loss_group_units(batch)  # rows a split may not cut (a preference pair)
        unit_lengths = [sum(lengths[row] for row in unit) for unit in units]
        local = count_micro_batches(unit_lengths, spec.max_tokens_per_mb, spec.n_mbs)
        count = int(all_reduce_scalar(local, self.device, op="max"))
        groups = [sorted(row for u in g for row in units[u]) for g in
                  partition_into_micro_batches(unit_lengths, spec.max_tokens_per_mb, count)]
        return groups, [pack_sequences(batch, g).to(self.device) if g else None for g in groups]

    def _weights(self, mbs: list[Optional[TensorDict]],
                 loss_weight_fn: LossWeightFn) -> tuple[list[float], float]:
        weights = [0.0 if mb is None else float(loss_weight_fn(mb)) for mb in mbs]
        bad = [w for w in weights if not math.isfinite(w) or w < 0]
        if bad:
            raise ValueError(f"loss_weight_fn returned {bad[0]}; weights must be finite and >= 0")
        total = self._dp_sum(sum(weights))
        if total <= 0:
            raise ValueError("loss_weight_fn gives a total weight of 0 over all micro-batches and "
                             "ranks: nothing to train on (e.g. every loss_mask is empty)")
        return weights, total

    # ------------------------------------------------------------------ primitives
    @torch.no_grad()
    def forward(self, batch: TensorDict, post_hook: Optional[PostHook] = None,
                aggregate_fn: Optional[Callable[[list[torch.Tensor]], Any]] = None) -> Any:
        """Per-token outputs of the local batch without gradients (model mode unchanged).

        `post_hook(logits, mb)` must return a per-token tensor [T, ...]; default: log-probs of
        the next tokens (critic: the values). The outputs are cut into one tensor per row, in
        the batch's original order, and passed to `aggregate_fn`; default: back to the padded
        [B, L, ...] layout (0 at padding; log-probs are 0 at each row's last real token)."""
        self._require_initialized()
        hook = post_hook or ((lambda v, mb: v.float()) if self.config.model.is_critic
                             else next_token_logprobs)
        groups, mbs = self._split(batch)
        per_row: dict[int, torch.Tensor] = {}
        for mb, rows in zip(mbs, groups, strict=True):
            if mb is None:
                self._forward.logits(self._forward.dummy())
                continue
            keep_per_row(per_row, hook(self._forward.logits(mb), mb), mb, rows, "post_hook",
                         batch["input_ids"].device)
        values = [per_row[i] for i in range(batch.shape[0])] if batch.numel() else []
        if aggregate_fn is not None:
            return aggregate_fn(values)
        if not values:
            return torch.zeros(batch["input_ids"].shape)
        return unpack_to_padded(values, batch["attention_mask"])

    def train_batch(self, batch: TensorDict, loss_fn: LossFn,
                    loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One AdamW step on the global weighted-mean loss (see module docstring).

        Returns loss, grad_norm (before clipping), lr, n_tokens, n_seqs (global), n_mbs (per
        rank) and update_successful (0.0 when the gradient norm was not finite: the step is
        skipped, weights and optimizer state stay as they were)."""
        optimizer, _ = self._require_initialized()
        self.model.train()
        groups, mbs = self._split(batch)
        weights, total = self._weights(mbs, loss_weight_fn)
        optimizer.zero_grad(set_to_none=True)
        done = backward_micro_batches(self._forward, self.config, self._fsdp_size, self._routers,
                                      mbs, groups, weights, total, loss_fn)
        grad_norm, ok = optimizer_step(self.model, optimizer,
                                       self.config.optimizer.gradient_clipping)
        moe_stats = {} if done.routing is None else done.routing.stats(total, self.device)
        return {
            **moe_stats,
            "loss": self._dp_sum(done.weighted_loss) / total,
            "grad_norm": grad_norm,
            "lr": float(optimizer.param_groups[0]["lr"]),
            "update_successful": 1.0 if ok else 0.0,
            **self._count_stats(mbs),
        }

    def accumulate_gradients(self, batch: TensorDict, loss_fn: LossFn,
                             outputs_hook: Optional[OutputsHook] = None
                             ) -> tuple[float, list[torch.Tensor]]:
        """Add the gradients of sum(loss_fn) over every micro-batch of every rank to those
        held since the last `apply_gradients` (no step, no normalisation: a sum loss).
        Returns (that sum over all ranks, this rank's rows' `outputs_hook(logits, mb)`, cut
        per row in the batch's order; [] without a hook)."""
        self._require_initialized()
        self.model.train()
        groups, mbs = self._split(batch)
        ones = [0.0 if mb is None else 1.0 for mb in mbs]
        done = backward_micro_batches(self._forward, self.config, self._fsdp_size, self._routers,
                                      mbs, groups, ones, 1.0, loss_fn, outputs_hook)
        outputs = [done.outputs[i] for i in range(batch.shape[0])] if outputs_hook else []
        return self._dp_sum(done.weighted_loss), outputs

    def apply_gradients(self, max_grad_norm: Optional[float] = None) -> dict[str, float]:
        """One optimizer step on the gradients `accumulate_gradients` gathered, then clear
        them. `max_grad_norm` (0: no clipping) overrides optimizer.gradient_clipping.
        Returns grad_norm (before clipping), lr, update_successful."""
        optimizer, _ = self._require_initialized()
        clip = self.config.optimizer.gradient_clipping if max_grad_norm is None else max_grad_norm
        grad_norm, ok = optimizer_step(self.model, optimizer, clip)
        return {"grad_norm": grad_norm, "lr": float(optimizer.param_groups[0]["lr"]),
                "update_successful": 1.0 if ok else 0.0}

    @torch.no_grad()
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn,
                   loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """The weighted-mean loss of `train_batch`, without gradients or a step."""
        self._require_initialized()
        _, mbs = self._split(batch)
        weights, total = self._weights(mbs, loss_weight_fn)
        weighted_loss = 0.0
        for mb, w in zip(mbs, weights, strict=True):
            if mb is None or w == 0:
                self._forward.logits(mb if mb is not None else self._forward.dummy())
                continue
            weighted_loss += float(scalar_loss(loss_fn(self._forward.logits(mb), mb))) * w
        return {"loss": self._dp_sum(weighted_loss) / total,
                **self._count_stats(mbs)}

    def _count_stats(self, mbs: list[Optional[TensorDict]]) -> dict[str, float]:
        real = [mb for mb in mbs if mb is not None]
        n_tokens = sum(int(mb["cu_seqlens"][-1]) for mb in real)
        n_seqs = sum(mb["cu_seqlens"].numel() - 1 for mb in real)
        shared = ({"n_forwarded_tokens": self._dp_sum(self._trees.forwarded)}
                  if self._trees is not None else {})
        return {"n_tokens": self._dp_sum(n_tokens),
                "n_seqs": self._dp_sum(n_seqs), "n_mbs": float(len(mbs)),
                **shared}

    def step_lr_scheduler(self) -> None:
        _, scheduler = self._require_initialized()
        scheduler.step()

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ LoRA
    @property
    def lora_enabled(self) -> bool:
        return self.config.lora.enabled

    def adapter_weights(self) -> Optional[AdapterWeights]:
        """Collective: the current LoRA adapter (config + full tensors) at rank 0, None on
        the other ranks. What travels to the fleet after each step instead of the model."""
        self._require_initialized()
        if not self.lora_enabled:
            raise ValueError("adapter_weights: this engine trains the full weights "
                             "(TrainEngineConfig.lora.rank = 0)")
        return lora_io.gather_adapter(self.model, self.rank)

    def base_model_view(self) -> lora_io.FrozenBaseView:
        """The frozen base model (adapters off) as an engine with `forward`: the KL
        reference of a LoRA run, without a second copy of the base weights."""
        if not self.lora_enabled:
            raise ValueError("base_model_view: this engine has no LoRA adapters; start a "
                             "separate reference engine instead")
        return lora_io.FrozenBaseView(self)

    # ------------------------------------------------------------------ checkpoints
    def save(self, meta: SaveLoadMeta) -> None:
        """`hf`: safetensors + config (+ `meta.tokenizer`) written by rank 0; `dcp`: the full
        training state (model, optimizer when `with_optim`, scheduler, RNG, version)."""
        optimizer, scheduler = self._require_initialized()
        if meta.weight_format == "hf":
            if meta.with_optim:
                raise ValueError("SaveLoadMeta(weight_format='hf') holds weights only; use "
                                 "weight_format='dcp' to save optimizer state")
            self._export_hf(meta.path, tokenizer=meta.tokenizer, copy_tokenizer=False)
        elif meta.weight_format == "dcp":
            self._dcp.save(meta.path, self.model, optimizer, scheduler,
                           {"version": self._version}, meta.with_optim, meta.async_save)
        else:
            raise ValueError(f"SaveLoadMeta.weight_format={meta.weight_format!r}: "
                             f"use 'hf' or 'dcp'")

    def wait_for_saves(self) -> None:
        self._dcp.wait()

    def saves_written(self) -> bool:
        return self._dcp.written(self.device)

    def load(self, meta: SaveLoadMeta) -> None:
        """Inverse of `save`; `dcp` with `with_optim=False` restores weights, RNG and version."""
        optimizer, scheduler = self._require_initialized()
        if meta.weight_format == "hf":
            if self.lora_enabled:
                raise ValueError("SaveLoadMeta(weight_format='hf') load into a LoRA engine: "
                                 "an HF folder holds merged weights; start from it with "
                                 "model.path, or load a 'dcp' checkpoint (base + adapter)")
            ckpt.load_hf_weights(self.model, meta.path, self.config.model.is_critic)
        elif meta.weight_format == "dcp":
            self._dcp.wait()  # (an asynchronous save of this engine's may be that path)
            extra = ckpt.load_dcp(meta.path, self.model, optimizer, scheduler,
                                  meta.with_optim)
            self._version = int(extra["version"])
        else:
            raise ValueError(f"SaveLoadMeta.weight_format={meta.weight_format!r}: "
                             f"use 'hf' or 'dcp'")
        dist.barrier()

    def update_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        """Export the current weights as an HF folder at `meta.path` (rank 0 writes; tokenizer
        files are copied from the model folder); every rank returns once the folder is complete.
        Returns {"update_weights_seconds": wall time of the export}."""
        self._require_initialized()
        if meta.type != "disk":
            raise ValueError(f"WeightUpdateMeta.type={meta.type!r}: the engine exports only "
                             f"'disk'; the distributed transport streams iter_weight_buckets "
                             f"(areal_like.runtime.weight_sync.push_weights)")
        start = time.perf_counter()
        if self.lora_enabled:  # the adapter alone: the fleet keeps the base
            if not meta.path:
                raise ValueError("WeightUpdateMeta.path is required")
            adapter = self.adapter_weights()
            if adapter is not None:
                lora_io.write_adapter_folder(adapter, meta.path)
            dist.barrier()
        else:
            self._export_hf(meta.path, tokenizer=None, copy_tokenizer=True)
        return {"update_weights_seconds": time.perf_counter() - start}

    def _served_layout(self) -> list[ckpt.ServedPiece]:
        if self.config.model.is_critic:
            raise ValueError("a critic's weights are not served: nothing to send to the fleet")
        if self.lora_enabled:
            raise ValueError("a LoRA engine sends its adapter (adapter_weights), not weight "
                             "buckets of the whole model")
        if self._served is None:  # the HF folder's tensors, which servers load by name
            params = list(self.model.named_parameters())  # tied weights once, as saved
            self._served = ckpt.served_layout(self.model, [name for name, _ in params],
                                              [tuple(p.shape) for _, p in params])
        return self._served

    def weight_specs(self) -> list[ParamSpec]:
        self._require_initialized()
        dtypes = {name: str(p.dtype).removeprefix("torch.")
                  for name, p in self.model.named_parameters()}
        return [ParamSpec(piece.name, dtypes[piece.param], piece.shape)
                for piece in self._served_layout()]

    def iter_weight_buckets(self, buckets: Sequence[Sequence[ParamSpec]]
                            ) -> Iterator[Optional[list[torch.Tensor]]]:
        self._require_initialized()
        yield from ckpt.iter_served_buckets(self.model, self._served_layout(), buckets,
                                            self.rank == 0)

    def _export_hf(self, path: Optional[str], tokenizer: Any, copy_tokenizer: bool) -> None:
        if not path:
            raise ValueError("an export path is required "
                             "(SaveLoadMeta.path / WeightUpdateMeta.path)")
        source = os.path.realpath(self.config.model.path)
        if os.path.realpath(path) == source:
            raise ValueError(f"refusing to export over the source model folder {path!r}")
        state_dict = ckpt.gather_full_state_dict(self.model)
        if self.rank == 0 and self.lora_enabled:  # a complete HF model: base + adapter merged
            state_dict = lora_io.merged_state_dict(self.model, state_dict)
        if self.rank == 0:
            tok_dir = self.config.model.tokenizer_path or self.config.model.path
            hf_model = self.model.get_base_model() if self.lora_enabled else self.model
            ckpt.write_hf_folder(hf_model, state_dict, path, tokenizer=tokenizer,
                                 copy_tokenizer_from=tok_dir if copy_tokenizer else None,
                                 processor_from=self.config.model.path)
        del state_dict
        dist.barrier()

