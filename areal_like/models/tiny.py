"""Build tiny Qwen2 models with a byte-level BPE tokenizer, fully offline.

    python -m areal_like.models.tiny --out DIR --size 1m|10m|50m|100m [--seed N]
    python -m areal_like.models.tiny --out DIR --arch qwen3_moe --size 1m|10m   (mixture of experts)

The tokenizer splits every digit into its own token (so arithmetic is learnable by a tiny
model) before a byte-level BPE, and carries a ChatML chat template. The folder is a standard
HF folder: `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(DIR)` and SGLang load it.
Everything is deterministic for a given (size, seed).
"""

from __future__ import annotations

import argparse
import random
import string
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeForCausalLM,
)

from areal_like.models.tiny_moe import MOE_SIZES, build_moe_config

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (vocab size, hidden, layers, heads, kv heads, intermediate)
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "1m": (512, 128, 4, 4, 2, 384),
    "10m": (1024, 256, 12, 4, 2, 768),
    "50m": (2048, 512, 16, 8, 4, 1536),
    "100m": (2048, 768, 14, 12, 4, 2304),
}

_WORDS = (
    "the a an of to and in is are was what how many much sum total answer question add plus "
    "minus times equals number result compute calculate find solve give tell me please first "
    "second then so we get final tool call memory insert update delete chunk user assistant "
    "system correct wrong try again feedback reward model policy value token step think"
).split()


def _training_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic text covering the chat format, arithmetic and plain words."""
    rng = random.Random(seed)
    printable = string.ascii_letters + string.digits + string.punctuation + " \n\t"
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            lines.append(f"{IM_START}user\nWhat is {a} + {b}?{IM_END}\n"
                         f"{IM_START}assistant\n{a + b}{IM_END}\n")
        elif kind == 1:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 15))) + ".")
        elif kind == 2:
            words = [rng.choice(_WORDS).capitalize() for _ in range(rng.randint(2, 8))]
            lines.append(", ".join(words) + f" = {rng.randint(-999, 999)}; #### {rng.random():.3f}")
        else:
            lines.append("".join(rng.choice(printable) for _ in range(rng.randint(5, 40))))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 1) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: digits split individually, then bytes, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def build_config(size: str, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    _, hidden, layers, heads, kv_heads, inter = SIZES[size]
    # written to config.json under these (pre-5.0 transformers) names, as SGLang reads them
    legacy: dict[str, Any] = {"rope_theta": 10000.0, "torch_dtype": "float32"}
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=token_id(tokenizer, PAD_TOKEN),
        eos_token_id=token_id(tokenizer, IM_END),
        pad_token_id=token_id(tokenizer, PAD_TOKEN),
        **legacy,
    )


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), f"{token!r} is not one token of the tiny tokenizer"
    return token_id


ARCHS = ("qwen2", "qwen3_moe")


def build_tiny_model(out: str | Path, size: str = "1m", seed: int = 1,
                     arch: str = "qwen2") -> Path:
    """Write a tokenizer + randomly initialised model to `out`; return the folder. `arch`:
    qwen2 (dense) or qwen3_moe (a mixture of experts, areal_like/models/tiny_moe.py)."""
    vocab_sizes = {"qwen2": {name: dims[0] for name, dims in SIZES.items()},
                   "qwen3_moe": {name: dims[0] for name, dims in MOE_SIZES.items()}}
    if arch not in vocab_sizes:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {list(ARCHS)}")
    if size not in vocab_sizes[arch]:
        raise ValueError(f"unknown tiny {arch} model size {size!r}; choose one of "
                         f"{sorted(vocab_sizes[arch])}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_sizes[arch][size], seed)
    model: PreTrainedModel
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(build_moe_config(
            size, tokenizer, token_id(tokenizer, PAD_TOKEN), token_id(tokenizer, IM_END)))
    else:
        model = Qwen2ForCausalLM(build_config(size, tokenizer))
    config = model.config
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--size", default="1m", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arch", default="qwen2", choices=ARCHS,
                        help="qwen2: dense; qwen3_moe: mixture of experts (sizes 1m, 10m)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build_tiny_model(args.out, args.size, args.seed, args.arch)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"wrote {args.size} {args.arch} model ({n_params / 1e6:.2f}M params) to {out} "
          f"in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
