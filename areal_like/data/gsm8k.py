"""Local math data in GSM8K form (`question`, `answer` ending in `#### final`), via HF datasets."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, load_dataset

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def final_answer(solution: str) -> str:
    """The text after the last `####`, commas removed (GSM8K writes 1,000)."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '#### final' marker: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(path: str | Path, size: int = 0) -> Dataset:
    """Load a local .jsonl/.parquet file with `question` and `answer` columns.

    Returns `id`, `question`, `answer` (the final answer), `solution` (the original answer
    text) and `messages`. `size > 0` keeps the first `size` rows.
    """
    path = Path(path)
    if path.suffix not in _FORMATS:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file {path} does not exist")
    raw = load_dataset(_FORMATS[path.suffix], data_files=str(path), split="train")
    missing = {"question", "answer"} - set(raw.column_names)
    if missing:
        raise ValueError(f"{path}: missing column(s) {sorted(missing)}; found {raw.column_names}")
    if size > 0:
        raw = raw.select(range(min(size, len(raw))))

    def convert(row: dict, idx: int) -> dict:
        try:
            answer = final_answer(row["answer"])
        except ValueError as e:
            raise ValueError(f"{path}: row {idx}: {e}") from e
        return {
            "id": f"gsm8k-{idx}",
            "question": row["question"],
            "answer": answer,
            "solution": row["answer"],
            "messages": [{"role": "user", "content": row["question"]}],
        }

    return raw.map(convert, with_indices=True, remove_columns=raw.column_names)
