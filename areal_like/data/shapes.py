"""A synthetic visual task: small generated pictures of coloured shapes, and a question.

Each item is a 56 x 56 picture (4 image tokens for the tiny Qwen2-VL: one per quarter, and
each shape sits in a quarter of its own) of filled squares, circles and triangles in red, green
or blue on white. Two kinds of question (`question`):
- "colour" (default): 1-3 shapes of different kinds, "What colour is the circle?"; the answer
  is a colour name (a third by guessing);
- "count": 1-4 shapes, "How many red shapes?"; the answer is a digit 0-4 (harder: the tiny
  model needs ~1200 SFT steps to leave the prior, measured in docs/vision.md).
With `worked_fraction` > 0, that share of count items gets a worked `target` for SFT: the
colour of every shape in reading order, then the count ("red; blue; red; #### 2"),
whose steps `count_step_labels` checks against the picture (process rewards, docs/vision.md).
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
STEP_DELIMITER = "; "


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
    cells = rng.sample(range(4), len(kinds))
    for cell, kind, colour in zip(cells, kinds, colours, strict=True):
        _draw(draw, kind, cell, COLOURS[colour], rng)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    # (colour, kind) in reading order: left to right, top to bottom
    shapes = [(c, k) for _, k, c in sorted(zip(cells, kinds, colours, strict=True))]
    if question == "colour":
        which = rng.randrange(len(kinds))
        return {"image": buffer.getvalue(), "question": f"What colour is the {kinds[which]}?",
                "answer": colours[which], "shapes": shapes}
    # mostly a colour that is there, so that answers spread over 0-4 instead of piling on 0
    asked = rng.choice(colours) if rng.random() < 0.75 else rng.choice(list(COLOURS))
    return {"image": buffer.getvalue(), "question": f"How many {asked} shapes?",
            "answer": str(colours.count(asked)), "shapes": shapes}


def worked_count(shapes: list[tuple[str, str]], answer: str) -> str:
    """The worked answer of a count item: the colour of each shape in reading order, then the
    count. (Colours, not kinds: the tiny model's frozen tower tells colours apart but hardly
    kinds, and neither the policy nor a PRM on that tower could check a kind; docs/vision.md.)"""
    return "".join(f"{c}{STEP_DELIMITER}" for c, _ in shapes) + f"#### {answer}"


def count_step_labels(steps: list[str], shapes: list[tuple[str, str]],
                      answer: str) -> list[int]:
    """Math-Shepherd labels of a worked count's steps: 1 while every step so far is right,
    0 from the first wrong one on. Step k < len(shapes) must name shape k's colour ("red"),
    the step after the last shape must be "#### <answer>"; any other step is wrong."""
    labels, right = [], True
    for k, step in enumerate(steps):
        text = step.removesuffix(STEP_DELIMITER).strip()
        if k < len(shapes):
            right = right and text == shapes[k][0]
        else:
            right = right and k == len(shapes) and text == f"#### {answer}"
        labels.append(int(right))
    return labels


def _in_test_split(png: bytes) -> bool:
    pixels = Image.open(io.BytesIO(png)).tobytes()
    return int.from_bytes(hashlib.sha256(pixels).digest()[:8], "little") % 5 == 0


def load_shapes(size: int, split: str = "train", seed: int = 1, question: str = "colour",
                worked_fraction: float = 0.0) -> Dataset:
    """`size` items of one split with `id`, `messages` (an image part and the question),
    `images` ([PNG bytes]), `answer`, `target` (what SFT teaches: the answer, or the worked
    answer for a `worked_fraction` share of count items) and `shapes` (reading order)."""
    if split not in ("train", "test"):
        raise ValueError(f"shapes: split={split!r}; expected 'train' or 'test'")
    if size < 1:
        raise ValueError(f"shapes: size={size}; expected >= 1")
    if not 0.0 <= worked_fraction <= 1.0:
        raise ValueError(f"shapes: worked_fraction={worked_fraction}; expected 0..1")
    if worked_fraction and question != "count":
        raise ValueError(f"shapes: worked_fraction={worked_fraction} needs question='count' "
                         f"(got {question!r})")
    rows: list[dict[str, Any]] = []
    index = 0
    while len(rows) < size:
        item = make_item(seed, index, question)
        if _in_test_split(item["image"]) == (split == "test"):
            content = [{"type": "image"}, {"type": "text", "text": item["question"]}]
            worked = random.Random(f"worked-{seed}-{index}").random() < worked_fraction
            rows.append({"id": f"shapes-{seed}-{index}", "images": [item["image"]],
                         "messages": [{"role": "user", "content": content}],
                         "answer": item["answer"],
                         "target": (worked_count(item["shapes"], item["answer"]) if worked
                                    else item["answer"]),
                         "shapes": [list(shape) for shape in item["shapes"]]})
        index += 1
    return Dataset.from_list(rows)
