"""What the data section's tokenizer-dependent keys mean: the tokenizer a run uses
(`model.tokenizer_path`) and prompts longer than `max_prompt_len` tokens (dropped and counted,
or an error, per `on_long_prompt`)."""

from __future__ import annotations

import logging
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from areal_like.api.config import DatasetConfig, ModelConfig
from areal_like.data.item_checks import check_prompts_tokenize
from areal_like.utils.chat import render_chat, set_chat_template_kwargs

logger = logging.getLogger("areal_like")


def load_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """`model.tokenizer_path`, or the model folder when it is empty."""
    key, path = ("model.tokenizer_path", model.tokenizer_path) if model.tokenizer_path else (
        "model.path", model.path)
    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"{key}={path!r} is not a folder with a tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={path!r}: cannot load a tokenizer from it: {e}") from e
    return set_chat_template_kwargs(tokenizer, model.chat_template_kwargs)


def prompt_lengths(dataset: Dataset, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Tokens of each item's `messages` under the chat template, generation prompt included
    (what a workflow sends as the prompt)."""
    if len(dataset) == 0:
        return []
    if "messages" not in dataset.column_names:
        raise KeyError(f"data items have no 'messages' to measure; columns: "
                       f"{dataset.column_names}")
    texts = [render_chat(tokenizer, m) for m in dataset[:]["messages"]]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def limit_prompt_length(dataset: Dataset, tokenizer: PreTrainedTokenizerBase,
                        config: DatasetConfig, name: str) -> tuple[Dataset, int]:
    """`dataset` without the prompts longer than `config.max_prompt_len` tokens, and how many
    were dropped; with `on_long_prompt=error` any long prompt is an error. `name` is the
    config section (`train_dataset`) for messages. Tasks whose items carry no chat `messages`
    (the memory agent, whose workflow builds each turn's prompt) are returned as they are."""
    if "messages" not in dataset.column_names:
        return dataset, 0  # prompts built per turn by the workflow (the memory agent)
    check_prompts_tokenize(dataset, tokenizer, f"{name} (type={config.type})")
    lengths = prompt_lengths(dataset, tokenizer)
    limit = config.max_prompt_len
    long = [i for i, n in enumerate(lengths) if n > limit]
    if not long:
        return dataset, 0
    longest = max(long, key=lambda i: lengths[i])
    what = (f"{name}: {len(long)} of {len(dataset)} prompts are longer than "
            f"{name}.max_prompt_len={limit} tokens (the longest, row {longest}, has "
            f"{lengths[longest]})")
    if config.on_long_prompt == "error":
        raise ValueError(f"{what}; raise {name}.max_prompt_len (and server.context_length) or "
                         f"set {name}.on_long_prompt=drop")
    if len(long) == len(dataset):
        raise ValueError(f"{what}: nothing is left to train on")
    dropped = set(long)
    logger.warning("%s: dropped them", what)
    return dataset.select([i for i in range(len(dataset)) if i not in dropped]), len(long)
