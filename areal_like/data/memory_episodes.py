"""Procedural episodes for the memory agent: one fact per chunk, hidden among chit-chat,
and questions that ask for the facts."""

from __future__ import annotations

import random
from typing import Any, Optional

from datasets import Dataset

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
_ATTRS = {"pet": ["cat", "dog", "parrot", "fish"], "color": ["red", "blue", "green", "gold"],
          "city": ["Paris", "Oslo", "Lima", "Kyoto"], "drink": ["tea", "coffee", "milk", "juice"]}
_CHATTER = ["How was your day?", "Pretty good, thanks.", "The weather is nice.",
            "Did you see the game?", "I am a bit tired.", "Let us meet later."]


def make_memory_episodes(n: int, seed: int = 1, n_chunks: int = 2,
                         rng: Optional[random.Random] = None) -> list[dict[str, Any]]:
    """Episodes whose chunks state one fact each amid chatter; questions ask for the facts."""
    rng = rng or random.Random(seed)
    episodes = []
    for e in range(n):
        chunks, questions, answers = [], [], []
        for _ in range(n_chunks):
            name, attr = rng.choice(_NAMES), rng.choice(sorted(_ATTRS))
            value = rng.choice(_ATTRS[attr])
            lines = rng.sample(_CHATTER, 2) + [f"{name}: my {attr} is {value}."]
            rng.shuffle(lines)
            chunks.append("\n".join(lines))
            questions.append(f"What is {name}'s {attr}?")
            answers.append(value)
        episodes.append({"id": f"memory-{seed}-{e}", "chunks": chunks,
                         "questions": questions, "answers": answers})
    return episodes


def load_memory_episodes(size: int, split: str = "train", seed: int = 1,
                         n_chunks: int = 2) -> Dataset:
    """`size` episodes; train and test use disjoint seeds."""
    offset = 0 if split == "train" else 1_000_003
    return Dataset.from_list(make_memory_episodes(size, seed + offset, n_chunks))
