"""Reasoning steps of a completion and where their process rewards sit.

A step is the text up to and including the next `delimiter` (the last step is the rest, if
any is left). A step's reward goes on the completion token that holds the step's last
character: the token whose decoded span contains it (a token that straddles the boundary
takes the reward of the step it ends). Token spans come from decoding the completion's own
ids, so the policy's tokens are never re-tokenized.
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase

from areal_like.utils.chat import decode_text


def split_steps(text: str, delimiter: str) -> list[str]:
    """`text` cut after every `delimiter` (kept at the end of its step); empty tail dropped.
    "".join(result) == text."""
    if not delimiter:
        raise ValueError("prm.step_delimiter is empty; set it to the text between steps "
                         "(e.g. '\\n' or '; ')")
    steps, start = [], 0
    while True:
        at = text.find(delimiter, start)
        if at < 0:
            break
        steps.append(text[start:at + len(delimiter)])
        start = at + len(delimiter)
    if start < len(text):
        steps.append(text[start:])
    return steps


def token_char_ends(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[int]:
    """end[i] = number of characters of decode(token_ids[:i+1]) (prefix decodes, so merged
    bytes and special-token handling match the full decode)."""
    return [len(decode_text(tokenizer, list(token_ids[:i + 1]), skip_special_tokens=True))
            for i in range(len(token_ids))]


def step_end_tokens(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int],
                    delimiter: str) -> tuple[list[str], list[int]]:
    """(steps of the decoded completion, index into `token_ids` of each step's last token)."""
    text = decode_text(tokenizer, list(token_ids), skip_special_tokens=True)
    steps = split_steps(text, delimiter)
    ends = token_char_ends(tokenizer, token_ids)
    positions, char_end, tok = [], 0, 0
    for step in steps:
        char_end += len(step)
        while tok < len(ends) and ends[tok] < char_end:
            tok += 1
        if tok == len(ends):
            raise ValueError(f"step ending at character {char_end} of {text!r} has no token "
                             f"(decoded prefixes end at {ends})")
        positions.append(tok)
    return steps, positions


def place_step_rewards(n_tokens: int, positions: Sequence[int],
                       scores: Sequence[float]) -> list[float]:
    """Dense per-token rewards: scores[k] on token positions[k] (summed if two steps share a
    token), 0 elsewhere."""
    if len(positions) != len(scores):
        raise ValueError(f"{len(scores)} step scores for {len(positions)} steps")
    dense = [0.0] * n_tokens
    for pos, score in zip(positions, scores, strict=True):
        if not 0 <= pos < n_tokens:
            raise ValueError(f"step-end token {pos} outside the completion (0..{n_tokens - 1})")
        dense[pos] += float(score)
    return dense
