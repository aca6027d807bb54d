"""Worker for tests/test_lora.py: LoRA training on `torchrun --nproc_per_node=N`.

Every rank holds its shard of the same batches; each step trains the adapter only. Rank 0
writes the adapter after each step, the base weights before and after, and the adapter after
a DCP save -> one more step -> load -> the same step again (exact resume) to <out>/results.pt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api import SaveLoadMeta
from areal_like.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.lora_config import LoRAConfig
from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.model_io import gather_full_state_dict
from engines.fsdp.packing import shard_batch

LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
LR = 2e-2


def config(model_dir: str) -> TrainEngineConfig:
    return TrainEngineConfig(model=ModelConfig(path=model_dir),
                             optimizer=OptimizerConfig(lr=LR, eps=1e-3), lora=LORA)


def batches(vocab: int, n: int = 3) -> list[TensorDict]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (4, 12), generator=gen)
        attn = torch.ones_like(ids)
        attn[1, 9:] = 0
        out.append(TensorDict({"input_ids": ids, "attention_mask": attn,
                               "loss_mask": attn.clone()}, batch_size=[4]))
    return out


def _mask(mb: TensorDict) -> torch.Tensor:
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()


def token_nll(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    m = _mask(mb)
    return -(next_token_logprobs(logits, mb) * m).sum() / m.sum()


def train(engine: FSDPEngine, batch: TensorDict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.train_batch(shard_batch(batch, rank, world, 1), token_nll,
                       lambda mb: _mask(mb).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # one group for both engines: re-creating a group under torchrun's store can deadlock
    dist.init_process_group("gloo")
    engine = FSDPEngine(config(args.model))
    engine.initialize()
    data = batches(int(engine.model.config.vocab_size))
    base_before = gather_full_state_dict(engine.model)
    adapters = [engine.adapter_weights()]  # the initial one: A drawn, B = 0
    for batch in data[:2]:
        train(engine, batch)
        adapters.append(engine.adapter_weights())
    base_after = gather_full_state_dict(engine.model)
    ckpt = Path(args.out) / "ckpt"
    engine.set_version(2)
    engine.save(SaveLoadMeta(str(ckpt), weight_format="dcp", with_optim=True))
    train(engine, data[2])
    continued = engine.adapter_weights()
    engine.destroy()

    resumed = FSDPEngine(config(args.model))
    resumed.initialize()
    resumed.load(SaveLoadMeta(str(ckpt), weight_format="dcp", with_optim=True))
    train(resumed, data[2])
    again = resumed.adapter_weights()
    version = resumed.get_version()
    if dist.get_rank() == 0:
        torch.save({"adapters": [a.tensors for a in adapters], "config": adapters[0].config,
                    "base_before": base_before, "base_after": base_after,
                    "continued": continued.tensors, "resumed": again.tensors,
                    "resumed_version": version, "world_size": dist.get_world_size()},
                   Path(args.out) / "results.pt")
    resumed.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
