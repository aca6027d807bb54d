"""The LoRA shapes the Tinker API trains (light: tinker-serve's launcher reads what its servers
must adapt without importing the trainer)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_like.api.lora_config import DECODER_LINEAR_MODULES

ATTENTION_MODULES = list(DECODER_LINEAR_MODULES[:4])  # q, k, v, o
MLP_MODULES = list(DECODER_LINEAR_MODULES[4:])  # gate, up, down
UNEMBED_MODULE = "lm_head"
# what the fleet must adapt to serve every shape (tinker-serve starts its servers so)
SERVED_MODULES = [*ATTENTION_MODULES, *MLP_MODULES, UNEMBED_MODULE]
LORA_ALPHA = 32  # Tinker's: the update is scaled by 32 / rank


@dataclass(frozen=True)
class LoRAShape:
    """What `create_model`'s lora_config asked for: adapters on the attention and / or MLP
    projections, and on the unembedding (lm_head) with train_unembed."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def target_modules(self) -> list[str]:
        return (ATTENTION_MODULES if self.train_attn else []) + (
            MLP_MODULES if self.train_mlp else []) + (
            [UNEMBED_MODULE] if self.train_unembed else [])
