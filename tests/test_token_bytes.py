"""The bytes of one token (`areal_like.utils.chat.token_bytes`, the gateway's logprob `bytes`),
where a token holds part of a character: a byte-level BPE trained here on text with two-,
three- and four-byte characters, and SentencePiece-style byte-fallback tokens. The reference
is the text's own UTF-8: the tokens' bytes, joined, are exactly it."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from areal_like.utils.chat import token_bytes

TRAINED_ON = ["東京 ✓ café naïve ok", "héllo wörld 京都"]
TEXT = "東北 ✗ café 𝔸 ok"  # characters it never saw: split into their bytes


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINED_ON * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_level_tokens_hold_the_bytes_of_their_part_of_a_character(byte_level):
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    parts = [token_bytes(byte_level, i) for i in ids]
    assert b"".join(parts) == TEXT.encode("utf-8")
    split = [p for p in parts if not _whole_characters(p)]
    assert split, "no token of this text splits a character: the case is not exercised"
    # decoding such a token alone gives U+FFFD, whose bytes are not the token's
    assert any("\ufffd" in byte_level.decode([i]) for i in ids)
    end = byte_level.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(byte_level, end) == b"<|im_end|>"


def test_byte_fallback_tokens_are_their_byte(byte_level):
    class ByteFallback:  # the part of a SentencePiece tokenizer that token_bytes reads
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return ["<0xE2>", "<0x9C>", "<0x93>", "▁ok"][token_id]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ok" if ids == [3] else "\ufffd"

    pieces = [token_bytes(ByteFallback(), i) for i in range(4)]
    assert b"".join(pieces[:3]).decode("utf-8") == "✓" and pieces[3] == b" ok"


def _whole_characters(part: bytes) -> bool:
    try:
        part.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
