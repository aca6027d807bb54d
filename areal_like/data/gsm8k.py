"""Local math data in GSM8K form (`question`, `answer` ending in `#### final`), via HF datasets."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, load_dataset

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def final_answer(solution: str) -> str:
    """The text after the last `####`, commas removed (GSM8K writes 1,000)."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '#### final' marker: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _check_row(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question' and 'answer', got "
                         f"{type(row).__name__}")
    for key in ("question", "answer"):
        if row.get(key) is None:
            what = "is null" if key in row else "is missing"
            raise ValueError(f"{where}: key {key!r} {what} (present: {sorted(row)})")
        if not isinstance(row[key], str) or not row[key].strip():
            raise ValueError(f"{where}: key {key!r} = {row[key]!r}; expected a non-empty string")
    return row


def _read_json_rows(path: Path) -> list[tuple[str, dict]]:
    """(location, row) of every row of a JSON-lines file (or a .json array), checked."""
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: the data file is empty")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
        return [(f"{path}: row {i}", _check_row(r, f"{path}: row {i}"))
                for i, r in enumerate(rows)]
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}): "
                             f"{line[:120]!r}") from None
        out.append((where, _check_row(row, where)))
    return out


def _read_parquet_rows(path: Path) -> list[tuple[str, dict]]:
    raw = load_dataset("parquet", data_files=str(path), split="train")
    if len(raw) == 0:
        raise ValueError(f"{path}: the data file has no rows")
    return [(f"{path}: row {i}", _check_row(row, f"{path}: row {i}"))
            for i, row in enumerate(raw)]


def load_gsm8k(path: str | Path, size: int = 0) -> Dataset:
    """Load a local .jsonl/.json/.parquet file with `question` and `answer` fields.

    Every row is checked when the file is loaded: a malformed line, a missing or null field
    or an answer without `#### final` is an error naming the file, the line (row) and the key.
    Returns `id`, `question`, `answer` (the final answer), `solution` (the original answer
    text) and `messages`. `size > 0` keeps the first `size` rows.
    """
    path = Path(path)
    if path.suffix not in _FORMATS:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file {path} does not exist")
    rows = _read_parquet_rows(path) if path.suffix == ".parquet" else _read_json_rows(path)
    if size > 0:
        rows = rows[:size]
    items = []
    for idx, (where, row) in enumerate(rows):
        try:
            answer = final_answer(row["answer"])
        except ValueError as e:
            raise ValueError(f"{where}: key 'answer': {e}") from None
        items.append({
            "id": f"gsm8k-{idx}",
            "question": row["question"],
            "answer": answer,
            "solution": row["answer"],
            "messages": [{"role": "user", "content": row["question"]}],
        })
    return Dataset.from_list(items)
