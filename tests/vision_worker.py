"""Worker for tests/test_vision.py: a vision-language model on `torchrun --nproc_per_node=2`.

Rank 0 holds the rows with images, rank 1 the row without: rank 1 never runs the vision tower,
which must not hang the collectives (the tower stays in the root FSDP unit). Each rank writes
its rows' log-probs before training, and rank 0 the full weights after one step, to <out>.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image
from tensordict import TensorDict

from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.models.vision import VisionProcessor, VisionPrompt, image_tensors
from areal_like.utils.batching import concat_padded
from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.model_io import gather_full_state_dict

LR, EPS = 1e-3, 1e-3
QUESTION = "How many shapes are there?"
RANK_ROWS = ([0, 1], [2])  # the rows each of two ranks trains on


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def messages(n_images: int) -> list[dict[str, Any]]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def image_batch(processor: VisionProcessor) -> tuple[TensorDict, list[VisionPrompt]]:
    """Three rows: one image, two images (of two sizes), no image; each with a generated answer
    that the loss covers."""
    prompts = [processor.prompt(messages(1), [noise_image(56, 56, 21)]),
               processor.prompt(messages(2), [noise_image(84, 56, 22), noise_image(56, 112, 23)]),
               processor.prompt([{"role": "user", "content": QUESTION}], [])]
    gen = torch.Generator().manual_seed(3)
    rows = []
    for prompt, n_out in zip(prompts, (6, 4, 7), strict=True):
        answer = torch.randint(3, 400, (n_out,), generator=gen).tolist()
        ids = torch.tensor([prompt.expanded_ids + answer])
        loss = torch.tensor([[0] * len(prompt.expanded_ids) + [1] * n_out])
        rows.append(TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                "loss_mask": loss, **image_tensors(prompt)}, batch_size=[1]))
    return concat_padded(rows), prompts


def config(model_dir: str, mb_spec: MicroBatchSpec) -> TrainEngineConfig:
    return TrainEngineConfig(model=ModelConfig(path=model_dir), mb_spec=mb_spec,
                             optimizer=OptimizerConfig(lr=LR, eps=EPS))


def mean_nll(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()
    return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum()


def n_loss_tokens(mb: TensorDict) -> float:
    return float(shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch, _ = image_batch(VisionProcessor(args.model))
    local = batch[torch.tensor(RANK_ROWS[rank])]
    engine = FSDPEngine(config(args.model, MicroBatchSpec(max_tokens_per_mb=128)))
    engine.initialize()
    out = Path(args.out)
    torch.save(engine.forward(local), out / f"logprobs_rank{rank}.pt")
    stats = engine.train_batch(local, mean_nll, n_loss_tokens)
    weights = gather_full_state_dict(engine.model)
    if rank == 0:
        torch.save({"weights": weights, "loss": stats["loss"],
                    "world_size": dist.get_world_size()}, out / "results.pt")
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
