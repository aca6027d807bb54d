"""Worker for tests/test_fsdp_engine.py, run as `torchrun --nproc_per_node=2 fsdp_worker.py`.

Runs every FSDPEngine scenario of the test in one launch (start-up is the slow part) and, on
rank 0, writes the inputs it used and everything it observed to <out>/results.pt. The test
computes the single-process references itself and compares.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api import SaveLoadMeta, WeightUpdateMeta
from areal_like.api.config import (
    MicroBatchSpec,
    ModelConfig,
    OptimizerConfig,
    TrainEngineConfig,
)
from areal_like.utils.packed_logprobs import (
    next_token_logprobs,
    next_token_logprobs_entropy,
    shift_packed_to_next_token,
)
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.model_io import gather_full_state_dict
from engines.fsdp.packing import shard_batch

LR = 1e-2
# A large Adam eps keeps the update a smooth function of the gradient (lr * g / (|g| + eps)),
# so parameter comparisons under a tolerance check the gradient itself; with eps = 1e-8 the
# first steps are ~lr * sign(g), which amplifies round-off where g is tiny.
ADAM_EPS = 1e-3
WEIGHT_DECAY = 0.01
TOTAL_STEPS = 4  # cosine schedule, warm-up 25 % = 1 step: step factors 0.5, 1.0, ...


def make_batch(seed: int, lengths: list[int], vocab: int) -> TensorDict:
    """Right-padded random sequences; the first third of each is a prompt (loss_mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    b, seq_len = len(lengths), max(lengths)
    ids = torch.full((b, seq_len), 0, dtype=torch.long)
    attn = torch.zeros(b, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        attn[i, :n] = 1
        loss_mask[i, n // 3:n] = 1
    targets = torch.randn(b, seq_len, generator=gen) * attn
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
                       "value_targets": targets}, batch_size=[b])


def _trained_mask(mb: TensorDict) -> torch.Tensor:
    """Position t is trained when the token it predicts (t+1, same sequence) has loss_mask 1."""
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()


def nll_loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    """Token-mean negative log-likelihood of the next tokens on loss_mask positions."""
    mask = _trained_mask(mb)
    return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum().clamp(min=1)


def nan_loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    return nll_loss(logits, mb) * float("nan")


def n_trained_tokens(mb: TensorDict) -> torch.Tensor:
    return _trained_mask(mb).sum()


def value_loss(values: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    mask = mb["loss_mask"].bool()
    return ((values - mb["value_targets"]) ** 2 * mask).sum() / mask.sum().clamp(min=1)


def engine_config(model: str, *, max_tokens: int = 4096, n_mbs: int = 1, critic: bool = False,
                  **overrides: Any) -> TrainEngineConfig:
    optim = OptimizerConfig(lr=LR, lr_scheduler_type="cosine", warmup_steps_proportion=0.25,
                            gradient_clipping=1.0, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)
    return TrainEngineConfig(model=ModelConfig(path=model, is_critic=critic), optimizer=optim,
                             mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens, n_mbs=n_mbs),
                             total_train_steps=TOTAL_STEPS, **overrides)


def full_params(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in gather_full_state_dict(engine.model).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    res: dict[str, Any] = {"world_size": world}

    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    batch1 = make_batch(1, [23, 7, 15, 30, 4, 11], vocab)
    batch2 = make_batch(2, [9, 26, 14, 5, 19], vocab)
    res["batch1"], res["batch2"] = batch1.to_dict(), batch2.to_dict()
    local1, local2 = shard_batch(batch1, rank, world), shard_batch(batch2, rank, world)
    res[f"local_rows_rank{rank}"] = int(local1.shape[0])

    # 1. The reference run: one micro-batch per rank, two steps, a DCP save in between.
    eng = FSDPEngine(engine_config(args.model))
    eng.initialize()
    fwd = FSDPEngine(engine_config(args.model, max_tokens=40))  # many micro-batches
    fwd.initialize()
    res["forward_logprobs"] = fwd.forward(batch1)
    res["forward_entropy"] = fwd.forward(
        batch1, post_hook=lambda lg, mb: next_token_logprobs_entropy(lg, mb)[1])
    res["forward_rows"] = fwd.forward(batch1, aggregate_fn=lambda rows: [r.clone() for r in rows])
    res["eval_loss_before"] = fwd.eval_batch(local1, nll_loss, n_trained_tokens)["loss"]
    fwd.destroy()

    res["step1"] = eng.train_batch(local1, nll_loss, n_trained_tokens)
    eng.step_lr_scheduler()
    eng.set_version(1)
    # written beside the next step (DCP async_save): the step changes the weights in place,
    # the checkpoint still holds step 1's (section 5 resumes from it)
    eng.save(SaveLoadMeta(str(out / "dcp"), weight_format="dcp", with_optim=True,
                          async_save=True))
    res["params_step1"] = full_params(eng)
    res["step2"] = eng.train_batch(local2, nll_loss, n_trained_tokens)
    eng.step_lr_scheduler()
    eng.wait_for_saves()
    res["params_step2"] = full_params(eng)

    # 2. Export for inference: HF folder + tokenizer; logits the engine sees right now.
    res["update_weights"] = eng.update_weights(WeightUpdateMeta.from_disk(str(out / "export"), 2))
    res["export_logits"] = eng.forward(batch1, post_hook=lambda lg, mb: lg.float())

    # 3. NaN loss: the step is skipped and nothing changes; the next step works again.
    before = full_params(eng)
    first = next(p for p in eng.model.parameters())
    adam_step_before = float(eng.optimizer.state[first]["step"])
    res["nan_step"] = eng.train_batch(local1, nan_loss, n_trained_tokens)
    after = full_params(eng)  # collective; the dicts are filled on rank 0 only
    res["nan_params_max_change"] = max(
        (float((v - before[k]).abs().max()) for k, v in after.items()), default=0.0)
    res["nan_adam_step_delta"] = float(eng.optimizer.state[first]["step"]) - adam_step_before
    res["after_nan_step"] = eng.train_batch(local1, nll_loss, n_trained_tokens)
    eng.destroy()

    # 4. Same two steps with >= 4 micro-batches per rank (some of them dummies).
    mb4 = FSDPEngine(engine_config(args.model, max_tokens=32, n_mbs=4))
    mb4.initialize()
    res["mb4_step1"] = mb4.train_batch(local1, nll_loss, n_trained_tokens)
    mb4.step_lr_scheduler()
    res["mb4_step2"] = mb4.train_batch(local2, nll_loss, n_trained_tokens)
    res["mb4_params_step2"] = full_params(mb4)
    mb4.destroy()

    # 5. Resume: a fresh engine loads the DCP checkpoint and takes step 2 again.
    resumed = FSDPEngine(engine_config(args.model))  # fresh: no optimizer state yet
    resumed.initialize()
    resumed.load(SaveLoadMeta(str(out / "dcp"), weight_format="dcp", with_optim=True))
    res["resumed_version"] = resumed.get_version()
    res["resumed_step2"] = resumed.train_batch(local2, nll_loss, n_trained_tokens)
    res["resumed_params_step2"] = full_params(resumed)

    # 6. HF save -> load round trip.
    resumed.load(SaveLoadMeta(str(out / "export"), weight_format="hf"))
    res["hf_loaded_params"] = full_params(resumed)

    # 7. A one-row batch: rank 1 has no rows at all and runs dummy micro-batches only.
    one_row = shard_batch(batch1[:1], rank, world)
    res["one_row_step"] = resumed.train_batch(one_row, nll_loss, n_trained_tokens)
    shapes: list[Any] = [None] * world
    dist.all_gather_object(shapes, (int(one_row.shape[0]), tuple(resumed.forward(one_row).shape)))
    res["one_row_rows_and_forward_shapes"] = shapes
    resumed.destroy()

    # 8. Mixed precision (bf16 params, fp32 reduce) + gradient checkpointing.
    bf16 = FSDPEngine(engine_config(args.model, param_dtype="bfloat16", reduce_dtype="float32",
                                    gradient_checkpointing=True))
    bf16.initialize()
    res["bf16_step1"] = bf16.train_batch(local1, nll_loss, n_trained_tokens)
    bf16.destroy()

    # 9. Critic: per-token values, a value-loss step, export.
    critic = FSDPEngine(engine_config(args.model, critic=True, max_tokens=40))
    critic.initialize()
    critic.update_weights(WeightUpdateMeta.from_disk(str(out / "critic_export"), 0))
    res["critic_values"] = critic.forward(batch1)
    res["critic_step1"] = critic.train_batch(local1, value_loss,
                                             lambda mb: mb["loss_mask"].sum())
    res["critic_values_after"] = critic.forward(batch1)
    critic.destroy()

    if rank == 0:
        torch.save(res, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
