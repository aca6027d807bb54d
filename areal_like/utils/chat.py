"""Text from a tokenizer: chat templates with keyword arguments from config (e.g.
`enable_thinking: false`), and decoding one sequence.

The arguments travel with the tokenizer (`set_chat_template_kwargs`), so every place that
renders a chat — workflows, prompt-length limits, SFT batches — renders it the same way, in
every process the tokenizer is sent to.
"""

from __future__ import annotations

from typing import Any

_ATTR = "_areal_like_chat_template_kwargs"


def set_chat_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """Make `kwargs` the defaults of every `render_chat` with `tokenizer`; returns it."""
    setattr(tokenizer, _ATTR, dict(kwargs))
    return tokenizer


def chat_template_kwargs(tokenizer: Any) -> dict[str, Any]:
    return dict(getattr(tokenizer, _ATTR, {}))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, **overrides: Any) -> str:
    """The chat template's text for `messages`; `overrides` win over the configured kwargs."""
    kwargs = {**chat_template_kwargs(tokenizer), **overrides}
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def decode_text(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one sequence of `token_ids` (HF's `decode` is typed for batches too)."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), f"decode returned {type(text).__name__}, not str"
    return text
