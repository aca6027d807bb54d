"""A process reward model that sees the picture: a VLM with a 2-label head on its last hidden
state, scoring each reasoning step at its last token (label 1 = every step so far is right).

    build_vision_prm(out, init_from)                 # a VLM folder + a new 2-label head
    train_vision_prm(out, examples, steps=300)       # examples: VisionPRMExample
    prm = VisionPRM(out); prm.scores(prompt, images, steps)   # p(label 1) per step

The folder is the VLM's own HF folder (weights, tokenizer, image processor; its LM head is
kept but unused) plus `prm_head.safetensors`, so transformers and SGLang read it unchanged.
The prompt is chat text holding one image pad per image (what the policy's workflow decodes
from its prompt ids); each step is tokenized on its own, so a step's last token is the same in
training and serving (as `prm_model.encode_steps` does for the text PRM).
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from areal_like.models.vision import ImageInput, VisionProcessor, VisionPrompt
from areal_like.rewards.prm_model import encode_steps

HEAD_FILE = "prm_head.safetensors"


@dataclass
class VisionPRMExample:
    prompt: str  # chat text with one image pad per image
    images: Sequence[ImageInput]
    steps: Sequence[str]
    labels: Sequence[int]


def is_vision_prm(path: str | Path) -> bool:
    return Path(path, HEAD_FILE).is_file()


def build_vision_prm(out: str | Path, init_from: str | Path, seed: int = 1) -> Path:
    """`out` := the VLM folder `init_from` (e.g. the policy's SFT warm start, which already
    reads the pictures and the answer format) + a freshly initialised 2-label head."""
    out, init_from = Path(out), Path(init_from)
    if not (init_from / "config.json").is_file():
        raise FileNotFoundError(f"init_from={str(init_from)!r} is not an HF model folder")
    if out.resolve() != init_from.resolve():
        shutil.copytree(init_from, out, dirs_exist_ok=True)
    VisionProcessor(out)  # refuses a folder that is not a VLM
    model = AutoModelForImageTextToText.from_pretrained(out)
    text = model.config.get_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(text.hidden_size, 2)
        torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
        torch.nn.init.zeros_(head.bias)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, out / HEAD_FILE)
    return out


class VisionPRM(torch.nn.Module):
    """The VLM backbone and the 2-label head of a vision PRM folder."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        path = Path(path)
        if not is_vision_prm(path):
            raise FileNotFoundError(f"{path} has no {HEAD_FILE}: not a vision PRM folder "
                                    f"(build one with build_vision_prm)")
        self.path = path
        self.processor = VisionProcessor(path)
        self.vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        self.vlm.lm_head.requires_grad_(False)  # unused: the head below reads the hidden state
        head = load_file(path / HEAD_FILE)
        self.head = torch.nn.Linear(head["weight"].shape[1], head["weight"].shape[0])
        if self.head.out_features != 2:
            raise ValueError(f"{path / HEAD_FILE}: {self.head.out_features} labels; expected 2")
        self.head.load_state_dict(head)

    def encode(self, prompt: str, images: Sequence[ImageInput], steps: Sequence[str]
               ) -> tuple[VisionPrompt, list[int], list[int]]:
        """(the prompt with its images, ids of prompt + steps with image pads expanded, index
        of each step's last token)."""
        tokenizer = self.processor.tokenizer
        ids, ends = encode_steps(tokenizer, prompt, steps)
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        vision = self.processor.prompt_from_ids(ids[:n_prompt], images)
        shift = len(vision.expanded_ids) - n_prompt
        return vision, vision.expanded_ids + ids[n_prompt:], [e + shift for e in ends]

    def logits(self, rows: Sequence[tuple[VisionPrompt, list[int]]]) -> torch.Tensor:
        """[B, T, 2] for right-padded rows of (prompt with images, full ids)."""
        width = max(len(ids) for _, ids in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (_, row) in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        image_id = self.processor.image_token_id
        hidden = self.vlm.model(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == image_id).long(),
            pixel_values=torch.cat([v.pixel_values for v, _ in rows]),
            image_grid_thw=torch.cat([v.image_grid_thw for v, _ in rows])).last_hidden_state
        return self.head(hidden)

    @torch.no_grad()
    def scores(self, prompt: str, images: Sequence[ImageInput],
               steps: Sequence[str]) -> list[float]:
        """p(label 1) at the last token of every step."""
        vision, ids, ends = self.encode(prompt, images, steps)
        probs = torch.softmax(self.logits([(vision, ids)])[0].double(), dim=-1)[:, 1]
        return [float(probs[e]) for e in ends]

    def save(self) -> None:
        self.vlm.save_pretrained(self.path, safe_serialization=True)
        save_file({k: v.detach().contiguous() for k, v in self.head.state_dict().items()},
                  self.path / HEAD_FILE)


def train_vision_prm(path: str | Path, examples: Sequence[VisionPRMExample], steps: int,
                     batch_size: int = 16, lr: float = 5e-4, seed: int = 1,
                     freeze_vision_tower: bool = True) -> dict[str, float]:
    """Train the vision PRM at `path` in place for `steps` batches (cross-entropy on the
    step-end tokens); returns {"steps", "loss"} of the last batch. The vision tower is frozen
    by default (docs/vision.md: training a tiny random tower with the rest merges colours)."""
    prm = VisionPRM(path)
    if freeze_vision_tower:
        prm.vlm.model.visual.requires_grad_(False)
    prm.train()
    trained = [p for p in prm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr)
    rng, loss = random.Random(seed), torch.tensor(float("nan"))
    encoded = [(prm.encode(e.prompt, e.images, e.steps), e.labels) for e in examples]
    for i, e in enumerate(examples):
        if len(e.labels) != len(e.steps):
            raise ValueError(f"example {i}: {len(e.labels)} labels for {len(e.steps)} steps")
    for _ in range(steps):
        batch = rng.sample(encoded, min(batch_size, len(encoded)))
        logits = prm.logits([(vision, ids) for (vision, ids, _), _ in batch])
        targets = torch.full(logits.shape[:2], -100, dtype=torch.long)
        for i, ((_, _, ends), labels) in enumerate(batch):
            targets[i, ends] = torch.tensor(list(labels))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    prm.save()
    return {"steps": float(steps), "loss": float(loss.detach())}


def step_accuracy(prm: VisionPRM, examples: Sequence[VisionPRMExample]) -> dict[str, Any]:
    """Share of steps whose score is on the right side of 0.5, overall and by label."""
    right = {0: [0, 0], 1: [0, 0]}
    for e in examples:
        for score, label in zip(prm.scores(e.prompt, e.images, e.steps), e.labels, strict=True):
            right[label][0] += int((score > 0.5) == bool(label))
            right[label][1] += 1
    total = sum(n for _, n in right.values())
    return {"accuracy": sum(r for r, _ in right.values()) / max(total, 1),
            "label0": right[0][0] / max(right[0][1], 1),
            "label1": right[1][0] / max(right[1][1], 1), "steps": total}
