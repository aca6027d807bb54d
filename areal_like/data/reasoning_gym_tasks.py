"""Any `reasoning-gym` task by name, as an HF dataset scored by the task's own verifier."""

from __future__ import annotations

import json

import reasoning_gym
from datasets import Dataset
from reasoning_gym.factory import DATASETS


def load_reasoning_gym(name: str, size: int = 1000, seed: int = 1) -> Dataset:
    """Items with `id`, `question`, `answer`, `metadata` (JSON string) and `messages`.

    Score completions with `areal_like.rewards.reasoning_gym_reward`.
    """
    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=3)
        raise KeyError(
            f"unknown reasoning-gym task {name!r}"
            + (f"; did you mean {close}?" if close else f"; {len(DATASETS)} tasks available")
        )
    source = reasoning_gym.create_dataset(name, size=size, seed=seed)
    rows = []
    for i in range(size):
        entry = source[i]
        rows.append({
            "id": f"{name}-{seed}-{i}",
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "metadata": json.dumps(entry["metadata"], default=str),
            "messages": [{"role": "user", "content": entry["question"]}],
        })
    return Dataset.from_list(rows)
