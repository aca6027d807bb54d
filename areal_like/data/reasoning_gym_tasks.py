"""Any `reasoning-gym` task by name, as an HF dataset scored by the task's own verifier."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from typing import Any, Optional

from datasets import Dataset

from areal_like.api.task_keys import unknown_parameters

TEST_FRACTION = 10  # one question in TEST_FRACTION belongs to the test split (by a hash)
MAX_DRAWS = 50  # candidates generated per item asked for, at most
# A size past what a task can give is refused once no new question (of either split) came in
# the last max(STALE_DRAWS, STALE_FACTOR x distinct questions seen) draws, not after the whole
# budget (a million draws, ~30 s, for size=20000). Questions drawn about equally often leave
# such a gap while one is still unseen with probability below e^-20; a question rarer than
# that could not be counted on anyway. Below STALE_DRAWS (under a second for most tasks) the
# whole budget is drawn, so small sizes get the exact count they always got.
STALE_DRAWS = 20_000
STALE_FACTOR = 20


def _split_of(question: str) -> str:
    digest = hashlib.blake2b(question.encode(), digest_size=4).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_FRACTION == 0 else "train"


def _registry() -> dict[str, Any]:
    """reasoning-gym's task registry, imported when a task is used: the package takes ~1.4 s
    to import, paid otherwise by every trainer and worker process of every run."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def task_parameters(name: str) -> list[str]:
    """The generator parameters of reasoning-gym task `name` (its config's fields)."""
    _check_name(name)
    config_cls = _registry()[name][1]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def _check_name(name: str) -> None:
    tasks = _registry()
    if name not in tasks:
        close = difflib.get_close_matches(name, list(tasks), n=3)
        raise KeyError(
            f"unknown reasoning-gym task {name!r}"
            + (f"; did you mean {close}?" if close else f"; {len(tasks)} tasks available")
        )


def load_reasoning_gym(name: str, size: int = 1000, seed: int = 1, split: str = "train",
                       params: Optional[dict[str, Any]] = None) -> Dataset:
    """`size` distinct items of `split` with `id`, `question`, `answer`, `metadata` (JSON
    string) and `messages`; `params` go to the task's generator (its config's fields).

    Every question belongs to one split by a hash of its text, so train and test never share a
    question whatever their seeds and sizes. Score completions with
    `areal_like.rewards.reasoning_gym_reward`.
    """
    if split not in ("train", "test"):
        raise ValueError(f"reasoning-gym task {name!r}: split={split!r}; expected 'train' or "
                         f"'test'")
    params = dict(params or {})
    accepted = task_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(unknown_parameters(f"reasoning-gym task {name!r}", unknown, accepted))
    import reasoning_gym

    try:
        source = reasoning_gym.create_dataset(name, size=size * MAX_DRAWS, seed=seed, **params)
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {name!r} rejected task_kwargs {params}: "
                         f"{e or type(e).__name__}") from e
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()  # every distinct question drawn, of both splits
    last_new = 0  # the draw that gave the latest new question
    budget = size * MAX_DRAWS
    for i in range(budget):
        entry = source[i]
        question = entry["question"]
        if question in seen:
            if i - last_new >= max(STALE_DRAWS, STALE_FACTOR * len(seen)):
                raise ValueError(_too_few(name, params, split, size, len(rows), i + 1,
                                          f"no new question in the last {i - last_new} "
                                          f"draws: the task has {len(seen)} distinct "
                                          f"questions of both splits"))
            continue
        seen.add(question)
        last_new = i
        if _split_of(question) != split:
            continue
        rows.append({
            "id": f"{name}-{split}-{seed}-{i}",
            "question": question,
            "answer": str(entry["answer"]),
            "metadata": json.dumps(entry["metadata"], default=str),
            "messages": [{"role": "user", "content": question}],
        })
        if len(rows) == size:
            return Dataset.from_list(rows)
    raise ValueError(_too_few(name, params, split, size, len(rows), budget,
                              f"{len(seen)} distinct questions of both splits"))


def _too_few(name: str, params: dict[str, Any], split: str, size: int, found: int,
             draws: int, why: str) -> str:
    return (f"reasoning-gym task {name!r} with {params or 'its default parameters'} gave only "
            f"{found} distinct {split} questions in {draws} draws, fewer than size={size} "
            f"({why}): lower the size to at most {found} or widen the parameters (task_kwargs)")
