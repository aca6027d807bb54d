"""Procedural episodes for the memory agent: one fact per chunk, hidden among chit-chat,
and questions that ask for the facts."""

from __future__ import annotations

import hashlib
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


TEST_FRACTION = 10  # one fact set in TEST_FRACTION belongs to the test split
MAX_DRAWS = 50  # draws per requested episode before giving up


def split_of(episode: dict[str, Any]) -> str:
    """The split an episode's facts belong to, by a hash: the same facts (whatever the chatter
    around them) never appear in both splits."""
    facts = "|".join(f"{q}={a}" for q, a in zip(episode["questions"], episode["answers"],
                                                    strict=True))
    digest = hashlib.blake2b(facts.encode(), digest_size=4).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_FRACTION == 0 else "train"


def load_memory_episodes(size: int, split: str = "train", seed: int = 1,
                         n_chunks: int = 2) -> Dataset:
    """`size` episodes of `split` with distinct fact sets; seeds vary which, and their order."""
    if split not in ("train", "test"):
        raise ValueError(f"memory_agent split={split!r}: expected 'train' or 'test'")
    rng = random.Random(seed if split == "train" else seed + 1_000_003)
    rows: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for _ in range(size * MAX_DRAWS):
        episode = make_memory_episodes(1, seed, n_chunks, rng=rng)[0]
        facts = (tuple(episode["questions"]), tuple(episode["answers"]))
        if facts in seen or split_of(episode) != split:
            continue
        seen.add(facts)
        rows.append({**episode, "id": f"memory-{split}-{seed}-{len(rows)}"})
        if len(rows) == size:
            return Dataset.from_list(rows)
    raise ValueError(f"memory_agent: only {len(rows)} distinct {split} episodes with "
                     f"n_chunks={n_chunks} in {size * MAX_DRAWS} draws, fewer than size={size}")
