"""A synthetic visual task: small generated pictures of coloured shapes, and a question.

Each item is a 56 x 56 picture (4 image tokens for the tiny Qwen2-VL: one per quarter, and
each shape sits in a quarter of its own) of filled squares, circles and triangles in red, green
or blue on white. Two kinds of question (`question`):
- "colour" (default): 1-3 shapes of different kinds, "What colour is the circle?"; the answer
  is a colour name (a third by guessing);
- "count": 1-4 shapes, "How many red shapes?"; the answer is a digit 0-4 (harder: the tiny
  model needs ~1200 SFT steps to leave the prior, measured in docs/vision.md).
Answers are checked by `exact_match_reward`. Items are a pure function of (seed, index); a
picture belongs to the test split when a hash of its pixels is 0 mod 5, else to train, so the
splits never share a picture whatever their sizes: held-out accuracy measures seeing, not
remembering.
"""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any

from datasets import Dataset
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
SHAPES = ("square", "circle", "triangle")
SIZE = 56
CELL = SIZE // 2  # a 2 x 2 grid: shapes never overlap
MAX_SHAPES = 4


def _draw(draw: ImageDraw.ImageDraw, shape: str, cell: int, colour: tuple[int, int, int],
          rng: random.Random) -> None:
    x0, y0 = (cell % 2) * CELL, (cell // 2) * CELL
    size = rng.randint(14, 22)
    left, top = x0 + rng.randint(2, CELL - size - 2), y0 + rng.randint(2, CELL - size - 2)
    box = (left, top, left + size, top + size)
    if shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "circle":
        draw.ellipse(box, fill=colour)
    else:
        draw.polygon([(left + size // 2, top), (left, top + size), (left + size, top + size)],
                     fill=colour)


QUESTIONS = ("colour", "count")


def make_item(seed: int, index: int, question: str = "colour") -> dict[str, Any]:
    """One item: PNG bytes of the picture, the question and the answer."""
    if question not in QUESTIONS:
        raise ValueError(f"shapes: question={question!r}; expected one of {QUESTIONS}")
    rng = random.Random(seed * 1_000_000_007 + index)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    if question == "colour":  # shapes of different kinds, so "the circle" is one shape
        kinds = rng.sample(SHAPES, rng.randint(1, len(SHAPES)))
    else:
        kinds = [rng.choice(SHAPES) for _ in range(rng.randint(1, MAX_SHAPES))]
    colours = [rng.choice(list(COLOURS)) for _ in kinds]
    for cell, kind, colour in zip(rng.sample(range(4), len(kinds)), kinds, colours,
                                  strict=True):
        _draw(draw, kind, cell, COLOURS[colour], rng)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    if question == "colour":
        which = rng.randrange(len(kinds))
        return {"image": buffer.getvalue(), "question": f"What colour is the {kinds[which]}?",
                "answer": colours[which]}
    # mostly a colour that is there, so that answers spread over 0-4 instead of piling on 0
    asked = rng.choice(colours) if rng.random() < 0.75 else rng.choice(list(COLOURS))
    return {"image": buffer.getvalue(), "question": f"How many {asked} shapes?",
            "answer": str(colours.count(asked))}


def _in_test_split(png: bytes) -> bool:
    pixels = Image.open(io.BytesIO(png)).tobytes()
    return int.from_bytes(hashlib.sha256(pixels).digest()[:8], "little") % 5 == 0


def load_shapes(size: int, split: str = "train", seed: int = 1,
                question: str = "colour") -> Dataset:
    """`size` items of one split with `id`, `messages` (an image part and the question),
    `images` ([PNG bytes]) and `answer`."""
    if split not in ("train", "test"):
        raise ValueError(f"shapes: split={split!r}; expected 'train' or 'test'")
    if size < 1:
        raise ValueError(f"shapes: size={size}; expected >= 1")
    rows: list[dict[str, Any]] = []
    index = 0
    while len(rows) < size:
        item = make_item(seed, index, question)
        if _in_test_split(item["image"]) == (split == "test"):
            content = [{"type": "image"}, {"type": "text", "text": item["question"]}]
            rows.append({"id": f"shapes-{seed}-{index}", "images": [item["image"]],
                         "messages": [{"role": "user", "content": content}],
                         "answer": item["answer"]})
        index += 1
    return Dataset.from_list(rows)
