"""The `actor.lora` section: train low-rank adapters (PEFT's LoRA) instead of every weight, and
serve the policy as base + adapter (only the adapter travels to the fleet after each step)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List

from areal_like.api.config_checks import FRACTION_BELOW_1, above, at_least, bounded, check_bounds
from areal_like.api.config_checks import check as _check

# Every linear layer of a Qwen2/Llama decoder block; the embeddings and the LM head stay frozen
# (the servers' LoRA kernels serve these seven).
DECODER_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class LoRAConfig:
    """Low-rank adapters on `target_modules`; `rank: 0` trains the full weights instead."""

    # of the adapters' A (r x in) and B (out x r); 0: no LoRA
    rank: int = bounded(0, bound=at_least(0, " (0: no LoRA, full weights)"))
    alpha: int = bounded(16, bound=above(0))  # the update is scaled by alpha / rank
    # on the adapters' input (training only)
    dropout: float = bounded(0.0, bound=FRACTION_BELOW_1)
    # the linear layers (by name, in every decoder block) that get adapters
    target_modules: List[str] = field(default_factory=lambda: list(DECODER_LINEAR_MODULES))
    adapter_name: str = "policy"  # what the fleet serves the policy as (requests name it)

    def __post_init__(self) -> None:
        name = "LoRAConfig"
        check_bounds(self, name)
        if self.enabled:
            _check(name, "target_modules", bool(self.target_modules), self.target_modules,
                   "a non-empty list of module names (e.g. q_proj, v_proj)")
        _check(name, "adapter_name", bool(_ADAPTER_NAME.match(self.adapter_name)),
               self.adapter_name, "letters, digits, '_', '-', '.'")
        if not self.enabled:  # the adapters' settings are unread without adapters
            unset_values: dict[str, object] = {
                "alpha": 16, "dropout": 0.0, "target_modules": list(DECODER_LINEAR_MODULES),
                "adapter_name": "policy"}  # the field defaults
            for key, unset in unset_values.items():
                _check(name, key, getattr(self, key) == unset, getattr(self, key),
                       f"unset ({unset!r}) with rank=0 (no adapters are trained, so nothing "
                       f"reads it): set lora.rank > 0 to train LoRA adapters")

    @property
    def enabled(self) -> bool:
        return self.rank > 0
