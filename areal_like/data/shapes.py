"""A synthetic visual task: count the shapes of one colour in a small generated image.

Each item is a 56 x 56 picture (4 image tokens for the tiny Qwen2-VL) with 1-4 filled shapes
(square, circle, triangle) in up to three colours on a white background, and a question:
"How many red shapes?" The answer is a digit (0-4); the verifier takes the first number of the
completion and compares exactly. Items are a pure function of (seed, index), and the held-out
split draws from a disjoint seed stream and drops any image that also occurs in training, so
held-out accuracy measures seeing, not remembering.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
from typing import Any

from datasets import Dataset
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
SHAPES = ("square", "circle", "triangle")
SIZE = 56
CELL = SIZE // 2  # a 2 x 2 grid: shapes never overlap
MAX_SHAPES = 4
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out split's seeds never meet the training ones


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


def make_item(seed: int, index: int) -> dict[str, Any]:
    """One item: PNG bytes of the picture, the question and the answer."""
    rng = random.Random(seed * 1_000_000_007 + index)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    n_shapes = rng.randint(1, MAX_SHAPES)
    colours = [rng.choice(list(COLOURS)) for _ in range(n_shapes)]
    for cell, colour in zip(rng.sample(range(4), n_shapes), colours, strict=True):
        _draw(draw, rng.choice(SHAPES), cell, COLOURS[colour], rng)
    # mostly a colour that is there, so that answers spread over 0-4 instead of piling on 0
    asked = rng.choice(colours) if rng.random() < 0.75 else rng.choice(list(COLOURS))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"image": buffer.getvalue(), "question": f"How many {asked} shapes?",
            "answer": str(colours.count(asked))}


def _image_hash(item: dict[str, Any]) -> str:
    return hashlib.sha256(Image.open(io.BytesIO(item["image"])).tobytes()).hexdigest()


def load_shapes(n_train: int, n_held_out: int, seed: int = 1) -> tuple[Dataset, Dataset]:
    """(train, held-out) datasets with columns image (PNG bytes), question, answer."""
    if n_train < 1 or n_held_out < 0:
        raise ValueError(f"shapes: n_train={n_train} must be >= 1 and n_held_out={n_held_out} "
                         f">= 0")
    train = [make_item(seed, i) for i in range(n_train)]
    seen = {_image_hash(item) for item in train}
    held_out: list[dict[str, Any]] = []
    index = 0
    while len(held_out) < n_held_out:
        item = make_item(seed + HELD_OUT_SEED_OFFSET, index)
        index += 1
        if _image_hash(item) not in seen:
            held_out.append(item)
    columns = ("image", "question", "answer")
    return (Dataset.from_dict({c: [item[c] for item in train] for c in columns}),
            Dataset.from_dict({c: [item[c] for item in held_out] for c in columns}))


_NUMBER = re.compile(r"\d+")


def shapes_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's first number is the answer, else 0.0 (no number: 0.0)."""
    found = _NUMBER.search(completion)
    return 1.0 if found is not None and found.group() == answer else 0.0
