"""Procedural episodes for the memory agent: one fact per chunk, hidden among chit-chat,
and questions that ask for the facts."""

from __future__ import annotations

import hashlib
import json
import random
import re
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


# The memory agent's prompts, shared by its workflow and its SFT demonstrations.
MEMORY_SYSTEM = ("Tools: memory_insert(content), memory_update(id, content), memory_delete(id). "
                 'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>')


def chunk_message(index: int, chunk: str) -> dict[str, str]:
    """The user turn that shows the agent chunk `index` (0-based) of a conversation."""
    return {"role": "user", "content": f"Chunk {index + 1}:\n{chunk}\nUpdate your memory."}


_QUESTION_STOPWORDS = {"what", "is", "s", "the", "a", "an", "of"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def answer_from_memory(entries: list[str], question: str) -> str:
    """A retrieval reader standing in for Mem-alpha's frozen QA model: the entry sharing the
    most words with the question (the latest on a tie; none shared: no answer) is read, and
    its last word is the answer ("Carol: my city is Lima." answers "lima")."""
    wanted = set(_words(question)) - _QUESTION_STOPWORDS
    best, best_score = "", 0
    for entry in entries:
        score = len(wanted & set(_words(entry)))
        if score >= best_score and score > 0:
            best, best_score = entry, score
    words = _words(best)
    return words[-1] if words else ""


def memory_write_demo(line: str) -> str:
    """The tool call that stores `line` (the SFT target format)."""
    body = json.dumps({"name": "memory_insert", "arguments": {"content": line}})
    return f"<tool_call>{body}</tool_call>"


FACT_SHARE = 0.5  # demos that store the fact line; the rest store a chatter line


def load_memory_demos(size: int, split: str = "train", seed: int = 1,
                      n_chunks: int = 2) -> Dataset:
    """SFT demonstrations of the tool-call format for the memory agent's warm start: each
    chunk's prompt with a call storing its fact line (a FACT_SHARE of the demos) or one of its
    chatter lines, so the warm start can write memory and copy a fact but has not learnt
    *what* to keep — RL has to teach that. (A tiny model needs many fact demos to copy names
    and values correctly, hence more than the uniform third.)"""
    episodes = load_memory_episodes(max(1, -(-size // n_chunks)), split, seed, n_chunks)
    rng = random.Random(seed + 17)
    rows = []
    for episode in episodes:
        for i, chunk in enumerate(episode["chunks"]):
            lines = chunk.splitlines()
            fact = next(line for line in lines if ": my " in line)
            chatter = [line for line in lines if line != fact]
            line = fact if rng.random() < FACT_SHARE else rng.choice(chatter)
            rows.append({"messages": [{"role": "system", "content": MEMORY_SYSTEM},
                                      chunk_message(i, chunk)],
                         "target": memory_write_demo(line), "answer": memory_write_demo(line)})
    return Dataset.from_list(rows[:size])
