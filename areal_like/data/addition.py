"""A procedural N-digit addition task: learnable by a 1M model, exactly verifiable.

Operands have exactly `num_digits` digits. Every (a, b) pair belongs to one split by a hash,
so train and test never share a problem; items are drawn with a seeded RNG, so a
(split, size, seed) triple always gives the same dataset.

Every item has a `target`, the completion SFT teaches: the bare sum, or for a `worked_fraction`
of the problems (chosen by a hash, so the model cannot tell which) the column-by-column work
and then `#### <sum>`, 10-15x longer. A model warm-started on that mix samples long answers
now and then, at any prompt: the heavy-tailed output lengths of reasoning RL, in miniature.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from datasets import Dataset

TEST_FRACTION = 10  # one pair in TEST_FRACTION belongs to the test split


def _pair_hash(a: int, b: int, salt: str = "") -> int:
    """A 32-bit hash of the pair, the same in every process and run."""
    digest = hashlib.blake2b(f"{salt}{a}+{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _split_of(a: int, b: int) -> str:
    return "test" if _pair_hash(a, b) % TEST_FRACTION == 0 else "train"


def addition_question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def worked_addition(a: int, b: int) -> str:
    """`a + b:`, the work column by column (least significant digit first), `#### <sum>`."""
    steps: list[str] = []
    carry, x, y = 0, a, b
    while x or y or not steps:
        terms = f"{x % 10} + {y % 10}" + (f" + {carry}" if carry else "")
        total = x % 10 + y % 10 + carry
        x, y = x // 10, y // 10
        last = not (x or y)
        carry = 0 if last else total // 10
        steps.append(f"{terms} = {total}, write {total if last else total % 10}"
                     + (", carry 1" if carry else ""))
    return f"{a} + {b}: " + "; ".join(steps) + f" #### {a + b}"


def make_addition_items(num_digits: int, size: int, split: str, seed: int,
                        worked_fraction: float = 0.0) -> list[dict]:
    """`size` distinct problems of `split` ('train' or 'test'), in seeded random order."""
    if not 0.0 <= worked_fraction <= 1.0:
        raise ValueError(f"addition task: worked_fraction={worked_fraction}; expected 0..1")
    if split not in ("train", "test"):
        raise ValueError(f"addition task: split={split!r}; expected 'train' or 'test'")
    if not 1 <= num_digits <= 18:
        raise ValueError(f"addition task: num_digits={num_digits}; expected 1..18")
    lo, hi = (0 if num_digits == 1 else 10 ** (num_digits - 1)), 10**num_digits - 1
    n_pairs = (hi - lo + 1) ** 2
    expected = n_pairs // TEST_FRACTION if split == "test" else n_pairs - n_pairs // TEST_FRACTION
    counted = n_pairs <= 100_000  # small enough to count the split's problems exactly
    if counted:
        expected = sum(_split_of(a, b) == split for a in range(lo, hi + 1)
                       for b in range(lo, hi + 1))
    if size > (expected if counted else 0.9 * expected):
        raise ValueError(
            f"addition task: size={size} is too large for {num_digits}-digit {split} split "
            f"({'' if counted else 'about '}{expected} distinct problems)"
        )
    rng = random.Random(f"addition-{num_digits}-{split}-{seed}")
    seen: set[tuple[int, int]] = set()
    items: list[dict[str, Any]] = []
    while len(items) < size:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen or _split_of(a, b) != split:
            continue
        seen.add((a, b))
        question = addition_question(a, b)
        items.append({
            "id": f"add{num_digits}-{split}-{len(items)}",
            "question": question,
            "answer": str(a + b),
            "target": (worked_addition(a, b) if _pair_hash(a, b, "worked") < worked_fraction * 2**32
                       else str(a + b)),
            "messages": [{"role": "user", "content": question}],
        })
    return items


def load_addition(num_digits: int = 2, size: int = 1000, split: str = "train",
                  seed: int = 1, worked_fraction: float = 0.0) -> Dataset:
    """The addition task as an HF dataset with `id`, `question`, `answer`, `target`,
    `messages`."""
    return Dataset.from_list(make_addition_items(num_digits, size, split, seed,
                                                 worked_fraction))
