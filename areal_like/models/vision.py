"""Prompts with images, for vision-language models (Qwen2-VL family).

An image reaches two places in two forms:
- the inference server gets it as a base64 PNG (`image_data`) beside prompt ids that hold
  one image pad token per image; the server's own processor expands each pad;
- the trainer gets the processor's output for the same pixels: `pixel_values` (one row per
  14 x 14 patch), `image_grid_thw` (t, h, w patches per image) and prompt ids in which each pad
  is repeated once per image token (t * h * w / merge_size**2), as the model reads them.
`VisionPrompt` carries both; `VisionProcessor` builds it with the model folder's own tokenizer
and image processor (HF's, the PIL backend: no torchvision needed).

Images are resized to the processor's target size (multiples of patch x merge pixels within
its pixel budget) *before* they are encoded, so neither the server nor the trainer resamples:
resampling differs between backends (SGLang's processor resizes with torchvision, ours with
PIL; measured 3.5e-4 apart in log-probability on a 300 x 200 image), identical pixels do not.
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from PIL import Image, UnidentifiedImageError

ImageInput = Union[Image.Image, str, os.PathLike, bytes]


class ImageInputError(ValueError):
    """An image could not be read; the message names which one and why."""


def load_image(image: ImageInput, where: str = "image") -> Image.Image:
    """An RGB PIL image from a PIL image, a file path or encoded bytes (PNG, JPEG, ...)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        source: Any = io.BytesIO(image)
        what = f"{len(image)} bytes"
    elif isinstance(image, (str, os.PathLike)):
        source = Path(image)
        what = f"file {str(image)!r}"
        if not source.is_file():
            raise ImageInputError(f"{where}: {what} does not exist")
    else:
        raise ImageInputError(f"{where}: expected a PIL image, a path or bytes, got "
                              f"{type(image).__name__}")
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ImageInputError(f"{where}: {what} is not a readable image ({e})") from e


def encode_image(image: Image.Image) -> str:
    """Base64 PNG (lossless, so the server decodes exactly the pixels the trainer processes)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class VisionPrompt:
    input_ids: list[int]  # for the server: one image pad per image
    image_data: list[str]  # base64 PNGs, in prompt order
    expanded_ids: list[int]  # for the trainer: each pad repeated per image token
    pixel_values: torch.Tensor  # float32 [n_patches, channels * t * patch * patch]
    image_grid_thw: torch.Tensor  # int64 [n_images, 3]


class VisionProcessor:
    """The tokenizer, image processor and image token of a vision-language model folder."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        if "image_token_id" not in config:
            raise ValueError(f"{path}/config.json has no image_token_id: not a vision-language "
                             f"model folder (model_type={config.get('model_type')!r})")
        self.image_token_id = int(config["image_token_id"])
        # tokens that mean images to the model: a completion must not hold them (the model
        # would read a generated pad as a place for image features that do not exist)
        self.vision_token_ids = tuple(sorted({
            int(config[key]) for key in ("image_token_id", "video_token_id",
                                         "vision_start_token_id", "vision_end_token_id")
            if config.get(key) is not None}))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.merge_size = int(self.image_processor.merge_size)
        self.factor = int(self.image_processor.patch_size) * self.merge_size
        size = self.image_processor.size
        self.min_pixels, self.max_pixels = int(size.shortest_edge), int(size.longest_edge)

    def resized(self, image: Image.Image) -> Image.Image:
        """`image` at the size the processor would resize it to (unchanged if it already is)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        height, width = smart_resize(image.height, image.width, factor=self.factor,
                                     min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        if (height, width) == (image.height, image.width):
            return image
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def tokens_per_image(self, image_grid_thw: torch.Tensor) -> list[int]:
        return [int(n) // self.merge_size**2 for n in image_grid_thw.prod(dim=-1)]

    def expand(self, input_ids: Sequence[int], image_grid_thw: torch.Tensor) -> list[int]:
        """`input_ids` with its k-th image pad repeated as many times as image k has tokens."""
        counts = self.tokens_per_image(image_grid_thw)
        n_pads = sum(1 for t in input_ids if t == self.image_token_id)
        if n_pads != len(counts):
            raise ValueError(f"the prompt holds {n_pads} image pad token(s) (id "
                             f"{self.image_token_id}) but {len(counts)} image(s) were given")
        expanded: list[int] = []
        images = iter(counts)
        for token in input_ids:
            expanded += [token] * next(images) if token == self.image_token_id else [token]
        return expanded

    def prompt(self, messages: list[dict[str, Any]], images: Sequence[ImageInput],
               add_generation_prompt: bool = True) -> VisionPrompt:
        """Chat `messages` whose content parts `{"type": "image"}` stand for `images`, in order."""
        n_parts = sum(1 for m in messages if not isinstance(m.get("content"), str)
                      for part in m["content"] if part.get("type") == "image")
        if n_parts != len(images):
            raise ValueError(f"the messages have {n_parts} image part(s) but {len(images)} "
                             f"image(s) were given")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        ids = self.tokenizer(str(text), add_special_tokens=False)["input_ids"]
        return self.prompt_from_ids(list(ids), images)

    def prompt_from_ids(self, input_ids: list[int], images: Sequence[ImageInput]) -> VisionPrompt:
        """Prompt ids with one image pad per image (already templated) plus the images."""
        pil = [self.resized(load_image(image, f"image {i}")) for i, image in enumerate(images)]
        if pil:
            processed = self.image_processor(images=pil, return_tensors="pt")
            pixel_values = processed["pixel_values"].to(torch.float32)
            grid = processed["image_grid_thw"].to(torch.int64)
        else:
            pixel_values = torch.zeros(0, self._patch_dim(), dtype=torch.float32)
            grid = torch.zeros(0, 3, dtype=torch.int64)
        return VisionPrompt(input_ids=list(input_ids), image_data=[encode_image(p) for p in pil],
                            expanded_ids=self.expand(input_ids, grid), pixel_values=pixel_values,
                            image_grid_thw=grid)

    def _patch_dim(self) -> int:
        p = self.image_processor
        return 3 * int(p.temporal_patch_size) * int(p.patch_size) ** 2


def image_tensors(prompt: VisionPrompt) -> dict[str, torch.Tensor]:
    """The images of one trajectory row, as batch keys: `pixel_values` [1, n_patches, D] and
    `image_grid_thw` [1, n_images, 3] (`utils.batching.concat_padded` pads rows together with
    zeros, and the trainer's packing drops the zero rows again)."""
    return {"pixel_values": prompt.pixel_values[None],
            "image_grid_thw": prompt.image_grid_thw[None]}
