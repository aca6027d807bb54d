"""Build a tiny Qwen2-VL vision-language model, fully offline.

    python -m areal_like.models.tiny_vl --out DIR [--seed N]

The language half is the 1m text model's shape (`areal_like.models.tiny`, same tokenizer plus
Qwen2-VL's four vision tokens); the vision tower is two ViT blocks of width 64 over 14-pixel
patches, merged 2 x 2 into one language token each, so a 56 x 56 image costs 4 tokens. The
folder is a standard HF folder: `AutoModelForImageTextToText`, `AutoTokenizer`,
`AutoImageProcessor` and SGLang (CPU engine) load it. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from areal_like.models.qwen2_vl_config import write_flat_config
from areal_like.models.tiny import IM_START, SIZES, build_tokenizer, token_id

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen2-VL's chat format: an image part renders as <|vision_start|><|image_pad|><|vision_end|>;
# the processor (or areal_like.models.vision) expands the one pad into the image's tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PATCH_SIZE = 14
MERGE_SIZE = 2
# Images are resized to multiples of 28 pixels within this area: 56 x 56 (4 tokens) to
# 112 x 112 (16 tokens).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
# The 1m text model's language half; head_dim 32 -> M-RoPE sections (t, h, w) sum to 16.
TEXT_SIZE = "1m"
MROPE_SECTION = [4, 6, 6]
VISION = {"depth": 2, "embed_dim": 64, "num_heads": 4, "mlp_ratio": 2, "in_channels": 3,
          "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2}


def build_vl_tokenizer(seed: int = 1) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(SIZES[TEXT_SIZE][0], seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2VLConfig:
    _, hidden, layers, heads, kv_heads, inter = SIZES[TEXT_SIZE]
    ids = {token: token_id(tokenizer, token) for token in VISION_TOKENS}
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": MROPE_SECTION},
            "bos_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    return Qwen2VLConfig(text_config=text, vision_config={**VISION, "hidden_size": hidden},
                         image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                         vision_start_token_id=ids[VISION_START],
                         vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)


def build_tiny_vl_model(out: str | Path, seed: int = 1) -> Path:
    """Write tokenizer + image processor + randomly initialised Qwen2-VL to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer(seed)
    config = build_vl_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    write_flat_config(out)
    tokenizer.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                               patch_size=PATCH_SIZE, merge_size=MERGE_SIZE)
    image_processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build_tiny_vl_model(args.out, args.seed)
    model = Qwen2VLForConditionalGeneration.from_pretrained(out)
    n_vision = sum(p.numel() for p in model.model.visual.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote tiny Qwen2-VL ({n_params / 1e6:.2f}M params, vision tower "
          f"{n_vision / 1e6:.2f}M) to {out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
