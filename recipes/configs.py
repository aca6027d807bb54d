"""Top-level config schemas of the recipes (registered for YAML defaults lists)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_like.api.config import BaseExperimentConfig, ModelConfig, TrainEngineConfig
from areal_like.api.config_checks import check, one_of
from areal_like.api.config_loader import register_config_dir, register_schema


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO family (and ReMax): the algorithm section picks estimator, loss, aggregation."""

    use_ref_model: bool = False  # frozen reference for KL (needs algorithm.kl_ctl > 0)
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)


@dataclass
class PPOConfig(GRPOConfig):
    """PPO with a learned critic (a value head on the LM) and GAE."""

    critic: TrainEngineConfig = field(
        default_factory=lambda: TrainEngineConfig(model=ModelConfig(is_critic=True))
    )


@dataclass
class MultiTurnConfig(GRPOConfig):
    max_turns: int = 3
    turn_discount: float = 0.9
    feedback: str = "Your answer is wrong. Please try again."


@dataclass
class AgentConfig(GRPOConfig):
    """The memory agent (Mem-alpha): tool calls build a memory, then the questions are
    answered from it; `gconfig.n_samples` rollouts per item."""

    max_steps: int = 1  # generated turns per chunk (each one action)
    beta: float = 0.05  # weight of memory compression (r3) in every action's reward
    gamma: float = 0.1  # weight of the action's content quality (r4)
    answerer: str = "retrieval"  # retrieval (a memory lookup) | policy (untrained turns)

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("AgentConfig", "answerer", self.answerer, ("retrieval", "policy"))
        check("AgentConfig", "max_steps", self.max_steps >= 1, self.max_steps, ">= 1")


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on (prompt, answer) pairs of a task (`train_dataset.batch_size`
    pairs per step)."""


SCHEMAS = {"grpo_schema": GRPOConfig, "ppo_schema": PPOConfig,
           "multi_turn_schema": MultiTurnConfig, "agent_schema": AgentConfig,
           "sft_schema": SFTConfig}
for _name, _cls in SCHEMAS.items():
    register_schema(_name, _cls)
# a user's YAML anywhere may build on the shipped ones: `defaults: [grpo_addition, _self_]`
register_config_dir(Path(__file__).resolve().parent / "conf")

# recipe name -> (config schema, default YAML in recipes/conf, needs an inference fleet)
RECIPES: dict[str, tuple[type, str, bool]] = {
    "grpo": (GRPOConfig, "grpo_addition.yaml", True),
    "remax": (GRPOConfig, "remax_addition.yaml", True),
    "ppo": (PPOConfig, "ppo_addition.yaml", True),
    "multi_turn": (MultiTurnConfig, "multi_turn_addition.yaml", True),
    "agent": (AgentConfig, "agent_memory.yaml", True),
    "sft": (SFTConfig, "sft_addition.yaml", False),
}
