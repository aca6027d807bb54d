"""Text from a tokenizer: chat templates with keyword arguments from config (e.g.
`enable_thinking: false`), decoding one sequence, and the bytes of one token.

The arguments travel with the tokenizer (`set_chat_template_kwargs`), so every place that
renders a chat — workflows, prompt-length limits, SFT batches — renders it the same way, in
every process the tokenizer is sent to.
"""

from __future__ import annotations

import re
from typing import Any

_ATTR = "_areal_like_chat_template_kwargs"
BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte tokens


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


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for, also where it holds part of a character (decoding
    it alone gives U+FFFD there): a byte-level BPE token's own bytes (GPT-2's byte-to-character
    table read backwards), a SentencePiece byte token's byte, else its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        fallback = BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if "ByteLevel" in str(getattr(backend, "decoder", "")):
            table = _BYTES_OF_CHARS
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
    return decode_text(tokenizer, [int(token_id)]).encode("utf-8")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_BYTES_OF_CHARS = _byte_level_table()
