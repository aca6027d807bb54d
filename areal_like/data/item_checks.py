"""Data items are checked where they enter (`build_task`), whatever the task's source: an empty
prompt, or an item without what its verifier needs, is refused naming the task and the item
(never trained on, never a reward of 0)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from datasets import Dataset
from transformers import PreTrainedTokenizerBase


def required_reward_keys(reward_fn: Callable[..., Any]) -> list[str]:
    """The data keys `reward_fn(prompt, completion, key, ...)` cannot be called without."""
    try:
        params = list(inspect.signature(reward_fn).parameters.values())
    except (TypeError, ValueError):
        return []  # no signature to read (a builtin)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    given = {"prompt", "completion", "completions", "prompt_ids", "completion_ids"}
    return [p.name for p in params[2:] if p.kind in named and p.default is p.empty
            and p.name not in given]


def prompt_text(messages: Any) -> str:
    """The text of the last user message of a chat prompt ("" when there is none); of a
    message made of parts (text and images), its text parts joined."""
    users = [m for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    return content if isinstance(content, str) else ""


def check_items(dataset: Dataset, reward_fn: Callable[..., Any], where: str) -> None:
    """ValueError naming `where` and the item's index: a chat prompt that is empty or
    whitespace only, or a key `reward_fn` needs that is missing, None or an empty string."""
    needed = required_reward_keys(reward_fn)
    columns = set(dataset.column_names)
    missing = [k for k in needed if k not in columns]
    if missing and len(dataset):
        raise ValueError(f"{where}: items have no {missing} (columns: {sorted(columns)}), which "
                         f"the verifier {getattr(reward_fn, '__name__', reward_fn)} needs")
    # the columns read in one batch: a `datasets` column iterated formats each row alone
    # (~20x slower; the pre-flight builds every generated task)
    rows = dataset[:] if len(dataset) else {c: [] for c in columns}
    ids = rows["id"] if "id" in columns else ["?"] * len(dataset)
    if "messages" in columns:  # items without (the memory agent): prompts built per turn
        for i, messages in enumerate(rows["messages"]):
            text = prompt_text(messages)
            if not text.strip():
                raise ValueError(f"{where} item {i} (id {ids[i]}): the prompt is empty "
                                 f"({text!r})")
    for key in needed:
        for i, value in enumerate(rows[key]):
            if value is None or (isinstance(value, str) and not value.strip()):
                raise ValueError(f"{where} item {i} (id {ids[i]}): {key}={value!r}, which the "
                                 f"verifier needs")


def check_prompts_tokenize(dataset: Dataset, tokenizer: PreTrainedTokenizerBase,
                           where: str) -> None:
    """ValueError naming the first item whose prompt text gives no token (e.g. only
    characters the tokenizer drops)."""
    if "messages" not in dataset.column_names or not len(dataset):
        return
    texts = [prompt_text(m) for m in dataset[:]["messages"]]
    for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        if not ids:
            raise ValueError(f"{where} item {i}: the prompt {texts[i]!r} tokenizes to nothing")
