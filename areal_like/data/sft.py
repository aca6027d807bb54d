"""Supervised batches from (messages, answer) items, and teacher-forced greedy accuracy."""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.models.vision import VisionProcessor, image_tensors
from areal_like.utils.batching import concat_padded
from areal_like.utils.chat import render_chat
from areal_like.utils.packed_logprobs import next_token_labels


def build_sft_batch(items: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> TensorDict:
    """Chat prompt + `target` (else `answer`) + EOS per item; `loss_mask` marks the completion
    and EOS tokens. Items with `images` (a vision-language model's, docs/vision.md) get the
    prompt as the model reads it and their images as `pixel_values` / `image_grid_thw`."""
    rows = []
    for item in items:
        images: dict[str, torch.Tensor] = {}
        if item.get("images") is not None:
            vision = _vision_processor(tokenizer.name_or_path)
            prompted = vision.prompt(item["messages"], item["images"])
            prompt, images = prompted.expanded_ids, image_tensors(prompted)
        else:
            text = render_chat(tokenizer, item["messages"])
            prompt = tokenizer.encode(text, add_special_tokens=False)
        answer = tokenizer.encode(str(item.get("target", item["answer"])),
                                  add_special_tokens=False)
        ids = prompt + answer + [tokenizer.eos_token_id]
        loss = [0] * len(prompt) + [1] * (len(answer) + 1)
        rows.append(TensorDict({
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
            "loss_mask": torch.tensor([loss], dtype=torch.bool), **images,
        }, batch_size=[1]))
    return concat_padded(rows)


@functools.lru_cache(maxsize=2)
def _vision_processor(model_path: str) -> VisionProcessor:
    return VisionProcessor(model_path)


def argmax_hits(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    """Per-token post-hook: 1 where the argmax prediction equals the next token."""
    return (logits.argmax(-1) == next_token_labels(mb["input_ids"], mb["cu_seqlens"])).float()


def greedy_exact_match(hits: torch.Tensor, batch: TensorDict) -> torch.Tensor:
    """[B] bool: every answer token is the argmax given the right prefix, which is exactly
    when greedy decoding reproduces the answer (and its EOS)."""
    shifted = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    shifted[:, :-1] = batch["loss_mask"][:, 1:].bool()  # position t predicts token t+1
    return ((hits > 0.5) | ~shifted).all(dim=-1)
