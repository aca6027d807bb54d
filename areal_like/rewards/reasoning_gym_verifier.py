"""Scoring with the verifier that ships with each `reasoning-gym` task."""

from __future__ import annotations

import json
from typing import Any

import reasoning_gym

from areal_like.rewards.exact_match import extract_final_answer


def reasoning_gym_reward(
    prompt: str, completion: str, answer: str, metadata: str | dict, **_: Any
) -> float:
    """Score with the task's own `score_answer` (found from `metadata['source_dataset']`).

    `metadata` is the item's reasoning-gym metadata (a JSON string as stored in the dataset).
    """
    meta = json.loads(metadata) if isinstance(metadata, str) else metadata
    if "source_dataset" not in meta:
        raise KeyError("reasoning_gym_reward: metadata has no 'source_dataset' key")
    score_fn = reasoning_gym.get_score_answer_fn(meta["source_dataset"])
    entry = {"question": prompt, "answer": answer, "metadata": meta}
    return float(score_fn(extract_final_answer(completion), entry))
