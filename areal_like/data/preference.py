"""Preference pairs for reward-model training and DPO: read (HF `datasets`), checked where they
enter (every error names the file and line, or the row), tokenised, batched.

A pair batch holds each pair as two adjacent rows, chosen then rejected: `loss_group_id` (the
pair's index in the batch) keeps both rows in one micro-batch and on one data-parallel rank,
`is_chosen` tells them apart, `loss_mask` marks the response tokens (and EOS, for DPO),
`margin` is the pair's own.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from areal_like.api.preference_config import PreferenceDataConfig
from areal_like.data.addition import make_addition_items
from areal_like.utils.chat import render_chat

if TYPE_CHECKING:  # the batch builder's; the launcher's check of pair files needs no torch
    import torch
    from tensordict import TensorDict

logger = logging.getLogger(__name__)
PAIR_KEYS = ("prompt", "chosen", "rejected")


class PreferenceDataError(ValueError):
    """A pair that cannot be trained on; the message names its file and line (or row)."""


@dataclass(frozen=True)
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float
    source: str  # where it came from: `file:line`, or `addition_pairs[i]`


def wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong answer to a + b of the kinds a policy drifts to: one digit of the sum changed
    (any position alike: a wrong tens digit must cost as much as a wrong units digit), a near
    miss across a carry, two digits swapped, or the right digits with one added or dropped."""
    right = str(a + b)
    while True:
        kind = rng.random()
        if kind < 0.6:
            position = rng.randrange(len(right))
            digit = str(rng.randint(1 if position == 0 else 0, 9))
            wrong = right[:position] + digit + right[position + 1:]
        elif kind < 0.7:
            wrong = str(a + b + rng.choice([-1, 1]) * rng.randint(1, 9))
        elif kind < 0.8:
            wrong = right[::-1].lstrip("0")
        elif kind < 0.9:  # a digit added at either end
            digit = str(rng.randint(0, 9))
            wrong = right + digit if rng.random() < 0.5 else digit.lstrip("0") + right
        else:  # a digit dropped
            wrong = right[:-1] if rng.random() < 0.5 else right[1:].lstrip("0")
        if wrong and wrong != right and not wrong.startswith("-"):
            return wrong


def addition_pair_rows(num_digits: int, size: int, split: str, seed: int) -> list[dict[str, Any]]:
    """The addition task's prompts (the main job's), each with its sum against a wrong answer
    (`wrong_answer`)."""
    rng = random.Random(f"addition-pairs-{num_digits}-{split}-{seed}")
    rows = []
    for i, item in enumerate(make_addition_items(num_digits, size, split, seed)):
        a, b = (int(x) for x in item["question"].removeprefix("What is ").rstrip("?").split(" + "))
        rows.append({"prompt": item["messages"], "chosen": item["answer"],
                     "rejected": wrong_answer(a, b, rng), "source": f"addition_pairs[{i}]"})
    return rows


def _file_rows(config: PreferenceDataConfig, name: str) -> list[dict[str, Any]]:
    path = Path(config.path)
    if not path.exists():
        raise FileNotFoundError(f"{name}.path={config.path!r} does not exist")
    if path.suffix == ".jsonl" and path.is_file():
        rows = _jsonl_rows(path, name)
    else:
        data = _dataset(config, path, name)
        missing = [k for k in PAIR_KEYS if k not in data.column_names]
        if missing:
            raise PreferenceDataError(f"{name}.path={config.path!r} has no column(s) {missing}; "
                                      f"a pair needs {list(PAIR_KEYS)} (columns: "
                                      f"{data.column_names})")
        rows = [{**data[i], "source": f"{path} row {i}"} for i in range(len(data))]
    if 0 < config.size < len(rows):
        logger.warning("%s: the first %d of %d pairs in %s (%s.size; 0: all)", name, config.size,
                    len(rows), path, name)
    return rows if config.size == 0 else rows[:config.size]


def _dataset(config: PreferenceDataConfig, path: Path, name: str) -> Any:
    """A .json / .parquet file or a dataset folder through HF `datasets` (its errors re-raised
    naming the path)."""
    import datasets

    try:
        if path.is_file():
            loaders = {".json": "json", ".parquet": "parquet"}
            if path.suffix not in loaders:
                raise PreferenceDataError(f"{name}.path={config.path!r}: expected a .jsonl, "
                                          f".json or .parquet file, or a dataset folder")
            data = datasets.load_dataset(loaders[path.suffix], data_files=str(path),
                                         split="train")
        else:
            saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
            data = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(
                str(path), split=config.split)
            if isinstance(data, datasets.DatasetDict):
                if config.split not in data:
                    raise PreferenceDataError(f"{name}.split={config.split!r}: {config.path} "
                                              f"has splits {sorted(data)}")
                data = data[config.split]
    except PreferenceDataError:
        raise
    except Exception as e:  # datasets' own errors: a malformed file, a folder it cannot read
        raise PreferenceDataError(f"{name}.path={config.path!r} cannot be read as a dataset: "
                                  f"{type(e).__name__}: {e}") from e
    return data


def _jsonl_rows(path: Path, name: str) -> list[dict[str, Any]]:
    """A .jsonl file's rows, each with its line (read here: the error names the line)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceDataError(f"{name} {path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise PreferenceDataError(f"{name} {path}:{number}: a row must be a JSON object "
                                          f"with {list(PAIR_KEYS)}, got {type(row).__name__}")
            rows.append({**row, "source": f"{path}:{number}"})
    return rows


def pair_rows(config: PreferenceDataConfig, name: str) -> list[dict[str, Any]]:
    """The section's rows, each with its `source`; not yet checked."""
    if config.type == "addition_pairs":
        digits = int(config.task_kwargs.get("num_digits", 2))
        return addition_pair_rows(digits, config.size, config.split, config.seed)
    return _file_rows(config, name)


def _prompt_text(value: Any, tokenizer: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m
                                                 for m in value):
        return render_chat(tokenizer, value)
    raise PreferenceDataError(f"{where}: 'prompt' must be a string or a list of chat messages "
                              f"({{role, content}}), got {type(value).__name__}")


def _response_text(value: Any, key: str, where: str) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0].get("content")  # [{"role": "assistant", "content": ...}]
    if not isinstance(value, str):
        raise PreferenceDataError(f"{where}: {key!r} must be a string or a list holding one "
                                  f"assistant message, got {type(value).__name__}")
    if not value.strip():
        raise PreferenceDataError(f"{where}: {key!r} is empty: a pair compares two responses")
    return value


def context_limit(config: PreferenceDataConfig, model_config: Any) -> int:
    """Tokens a pair's sequence may have: `max_length`, and the model's context."""
    context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    return min(config.max_length, int(context)) if context else config.max_length


def tokenize_pairs(rows: list[dict[str, Any]], tokenizer: Any, limit: int, name: str,
                   add_eos: bool) -> list[PreferencePair]:
    """Check and tokenise rows. `add_eos` (DPO): each response ends with EOS, which the policy
    must learn to emit; a reward model scores the text as written (no EOS), as it will be
    served. A row at fault raises `PreferenceDataError` naming its source."""
    pairs = []
    for row in rows:
        where = f"{name} {row['source']}"
        missing = [k for k in PAIR_KEYS if row.get(k) is None]
        if missing:
            raise PreferenceDataError(f"{where}: missing {missing}; a pair needs "
                                      f"{list(PAIR_KEYS)}")
        prompt = _prompt_text(row["prompt"], tokenizer, where)
        chosen = _response_text(row["chosen"], "chosen", where)
        rejected = _response_text(row["rejected"], "rejected", where)
        if chosen == rejected:
            raise PreferenceDataError(f"{where}: 'chosen' and 'rejected' are identical "
                                      f"({chosen[:60]!r}): the pair prefers nothing")
        margin = row.get("margin")
        margin = 0.0 if margin is None else margin  # optional (a columnar file's gap: None)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) \
                or not math.isfinite(margin):
            raise PreferenceDataError(f"{where}: 'margin' must be a finite number, got "
                                      f"{margin!r}")
        eos = [tokenizer.eos_token_id] if add_eos else []
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (prompt, chosen, rejected)]
        longest = len(ids[0]) + max(len(ids[1]), len(ids[2])) + len(eos)
        if longest > limit:
            raise PreferenceDataError(f"{where}: {longest} tokens (prompt + longest response"
                                      f"{' + EOS' if eos else ''}) exceed the limit of {limit} "
                                      f"({name}.max_length, and the model's context)")
        pairs.append(PreferencePair(ids[0], ids[1] + eos, ids[2] + eos, float(margin),
                                    row["source"]))
    return pairs


def load_pairs(config: PreferenceDataConfig, tokenizer: Any, model_config: Any, name: str,
               add_eos: bool) -> list[PreferencePair]:
    pairs = tokenize_pairs(pair_rows(config, name), tokenizer,
                           context_limit(config, model_config), name, add_eos)
    if not pairs:
        raise PreferenceDataError(f"{name} (type={config.type}) holds no pairs")
    return pairs


def build_pair_batch(pairs: list[PreferencePair], device: Optional[torch.device] = None
                     ) -> TensorDict:
    """Two rows per pair, chosen then rejected (see module docstring)."""
    import torch
    from tensordict import TensorDict

    from areal_like.utils.batching import concat_padded

    rows = []
    for index, pair in enumerate(pairs):
        for chosen, response in ((True, pair.chosen_ids), (False, pair.rejected_ids)):
            ids = pair.prompt_ids + response
            rows.append(TensorDict({
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
                "loss_mask": torch.tensor([[0] * len(pair.prompt_ids) + [1] * len(response)],
                                          dtype=torch.bool),
                "loss_group_id": torch.tensor([index]),
                "is_chosen": torch.tensor([chosen]),
                "margin": torch.tensor([pair.margin], dtype=torch.float32),
            }, batch_size=[1]))
    batch = concat_padded(rows)
    return batch.to(device) if device is not None else batch
