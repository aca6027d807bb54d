"""Qwen2-VL's config.json in its original (flat) layout, which SGLang reads.

Released Qwen2-VL checkpoints keep the language model's keys at the top level, with
`rope_scaling` and the vision tower's `in_chans`; SGLang's Qwen2-VL reads them there.
transformers 5 saves a nested `text_config` and `rope_parameters` instead (and reads either
layout back), so a folder it wrote does not start an SGLang server ("'Qwen2VLVisionConfig'
object has no attribute 'in_chans'"). Both the tiny model's builder and the trainer's HF
export rewrite config.json with this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLAT_MODEL_TYPES = ("qwen2_vl",)


def write_flat_config(folder: str | Path) -> None:
    """Rewrite `folder`/config.json in the flat layout when it is a nested Qwen2-VL config;
    leave any other config as it is."""
    path = Path(folder) / "config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    if config.get("model_type") not in FLAT_MODEL_TYPES or "text_config" not in config:
        return
    text = config.pop("text_config")
    rope = text.pop("rope_parameters", None) or {}
    for key in ("model_type", "layer_types", "dtype", "transformers_version"):
        text.pop(key, None)
    config.update(text)
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if "mrope_section" in rope:
        config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config["torch_dtype"] = config.get("dtype", "float32")
    vision = config["vision_config"]
    vision.setdefault("in_chans", vision.get("in_channels", 3))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
