"""Top-level config schemas of the recipes (registered for YAML defaults lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_like.api.config import BaseExperimentConfig, TrainEngineConfig
from areal_like.api.config_loader import register_schema


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO family: the algorithm section picks estimator, loss and aggregation."""

    use_ref_model: bool = False  # frozen reference for KL (needs algorithm.kl_ctl > 0)
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on (prompt, answer) pairs of a task."""

    batch_size: int = 64
    eval_every: int = 50


register_schema("grpo_schema", GRPOConfig)
register_schema("sft_schema", SFTConfig)

# recipe name -> (config schema, default YAML in recipes/conf, needs an inference fleet)
RECIPES: dict[str, tuple[type, str, bool]] = {
    "grpo": (GRPOConfig, "grpo_addition.yaml", True),
    "sft": (SFTConfig, "sft_addition.yaml", False),
}
