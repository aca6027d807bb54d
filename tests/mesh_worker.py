"""Worker for tests/test_trainer_mesh.py, run as `torchrun --nproc_per_node=4 mesh_worker.py`.

One engine per layout of the trainer's mesh on 4 ranks: Ulysses SP = 2 (x 2 data-parallel
ranks), SP = 4, tensor parallelism TP = 2 x 2 FSDP ranks, TP = 2 x SP = 2 with activation
checkpointing of every other decoder layer (and a checkpoint of it, saved asynchronously and
resumed by a fresh engine), and LoRA adapters at SP = 2. Each records
its per-token outputs, two training steps (the gradients each step applied, captured before
the optimizer steps), the parameters after them, the statistics the loss recorded, and the
weights as the fleet receives them (HF folder, process-group buckets). The test compares them
with a single-process float64 reference of the same batches. Micro-batches of at most 40
tokens pack odd-length rows, so sequence boundaries fall inside ranks' chunks.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import fsdp_worker as W
import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers.modeling_layers import GradientCheckpointingLayer

from areal_like.api import SaveLoadMeta, WeightUpdateMeta
from areal_like.api.lora_config import LoRAConfig
from areal_like.api.parallel_config import ParallelConfig
from areal_like.utils import stats_tracker
from areal_like.utils.packed_logprobs import next_token_logprobs_entropy
from engines.fsdp import packed_forward
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.packing import shard_batch
from engines.fsdp.ulysses import shard_inputs


def recorded_nll(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    """The worker's NLL, recording its trained tokens as a loss function of an actor does."""
    stats_tracker.denominator(n_trained=W._trained_mask(mb))
    return W.nll_loss(logits, mb)


def applied_gradients(engine: FSDPEngine) -> list[dict[str, torch.Tensor]]:
    """Filled with the full gradients every time the engine's optimizer steps (collective)."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []

    def snapshot(optimizer: Any, args: Any, kwargs: Any) -> None:
        seen.append({names[id(p)]: p.grad.full_tensor().clone()
                     for group in optimizer.param_groups for p in group["params"]})

    engine.optimizer.register_step_pre_hook(snapshot)
    return seen


SPLITS: list[tuple[list[int], int]] = []  # (cu_seqlens, padding) of every split micro-batch


def recording_splits(*args: Any, **kwargs: Any) -> Any:
    shard, ids, inputs = shard_inputs(*args, **kwargs)
    SPLITS.append((args[0]["cu_seqlens"].tolist(), shard.padding))
    return shard, ids, inputs


LAYOUTS = {"sp2": ParallelConfig(sequence_parallel_size=2),
           "sp4": ParallelConfig(sequence_parallel_size=4),
           "tp2": ParallelConfig(tensor_parallel_size=2),
           "tp2sp2": ParallelConfig(sequence_parallel_size=2, tensor_parallel_size=2),
           "lora_sp2": ParallelConfig(sequence_parallel_size=2)}
LORA = LoRAConfig(rank=4, alpha=8)


# tp2sp2 also recomputes every other decoder layer in the backward; lora_sp2 trains adapters
SETTINGS: dict[str, dict[str, Any]] = {
    "tp2sp2": {"gradient_checkpointing": True, "gradient_checkpointing_every": 2},
    "lora_sp2": {"lora": LORA}}


RESUMED = "tp2sp2"  # checkpointed after step 1 (asynchronously), resumed by a fresh engine


def layout_engine(model: str, name: str) -> FSDPEngine:
    eng = FSDPEngine(W.engine_config(model, max_tokens=40, parallel=LAYOUTS[name],
                                     **SETTINGS.get(name, {})))
    eng.initialize()
    return eng


def run_layout(model: str, name: str, batches: list[TensorDict], out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    eng = layout_engine(model, name)
    checkpoint = SaveLoadMeta(str(out / f"dcp_{name}"), weight_format="dcp", with_optim=True,
                              async_save=True)
    grads = applied_gradients(eng)  # (before a forward: FSDP keeps the root's unsharded)
    res["checkpointed_layers"] = sum(m.gradient_checkpointing for m in eng.model.modules()
                                     if isinstance(m, GradientCheckpointingLayer))
    res["dp"] = (eng.data_parallel_rank, eng.data_parallel_size)
    res["forward"] = eng.forward(batches[0], post_hook=lambda lg, mb: torch.stack(
        next_token_logprobs_entropy(lg, mb), dim=-1))
    for i, batch in enumerate(batches):
        local = shard_batch(batch, eng.data_parallel_rank, eng.data_parallel_size)
        res[f"step{i + 1}"] = eng.train_batch(local, recorded_nll, W.n_trained_tokens)
        res[f"recorded{i + 1}"] = stats_tracker.export()
        eng.step_lr_scheduler()
        if i == 0 and name == RESUMED:
            eng.save(checkpoint)  # written beside step 2
    res["grads"] = grads
    res["splits"] = list(SPLITS)
    res["params"] = W.full_params(eng)
    if name == RESUMED:
        eng.wait_for_saves()
        resumed = layout_engine(model, name)
        resumed.load(checkpoint)
        local = shard_batch(batches[1], eng.data_parallel_rank, eng.data_parallel_size)
        res["resumed_step2"] = resumed.train_batch(local, recorded_nll, W.n_trained_tokens)
        res["resumed_params"] = W.full_params(resumed)
        resumed.destroy()
        stats_tracker.export()  # (its records are not the next layout's)
    SPLITS.clear()
    eng.update_weights(WeightUpdateMeta.from_disk(str(out / f"export_{name}"), 2))
    if eng.lora_enabled:  # the adapter alone travels (disk folder above, or in memory)
        adapter = eng.adapter_weights()
        res["adapter"] = None if adapter is None else adapter.tensors
    else:  # what the process-group transport streams to the fleet
        specs = eng.weight_specs()
        (bucket,) = list(eng.iter_weight_buckets([specs]))
        res["buckets"] = (None if bucket is None
                          else {s.name: t for s, t in zip(specs, bucket, strict=True)})
    eng.destroy()
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    packed_forward.shard_inputs = recording_splits  # type: ignore[assignment]
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    batch1 = W.make_batch(1, [23, 7, 15, 30, 4, 11], vocab)
    batch2 = W.make_batch(2, [9, 26, 14, 5, 19], vocab)
    res: dict[str, Any] = {"world_size": world, "batch1": batch1.to_dict(),
                           "batch2": batch2.to_dict()}
    for name in LAYOUTS:
        res[name] = run_layout(args.model, name, [batch1, batch2], out)
    critic = FSDPEngine(W.engine_config(args.model, critic=True, max_tokens=40,
                                        parallel=ParallelConfig(sequence_parallel_size=2)))
    critic.initialize()
    critic.update_weights(WeightUpdateMeta.from_disk(str(out / "critic_export"), 0))
    res["critic_values"] = critic.forward(batch1)
    critic.destroy()
    if rank == 0:
        torch.save(res, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
