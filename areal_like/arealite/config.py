"""AReaL-lite's config classes: ours, plus the sections and keys an AReaL-lite script reads.

`load_expr_config(args, GRPOConfig)` with these classes reads an AReaL-lite experiment YAML as
AReaL-lite writes it (`api/arealite_keys.py` maps each key to ours): the script then finds
`config.saver`, `config.stats_logger`, `config.actor.kl_ctl`, `config.tokenizer_path`,
`config.total_train_epochs`, `config.train_dataset.drop_last`, ... where AReaL-lite keeps them,
and our engines find theirs (`config.model`, `config.algorithm`, `config.logging`, ...).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from areal_like.api.algorithm_config import MOVED_KEYS, AlgorithmConfig
from areal_like.api.arealite_keys import ACTOR_ALGORITHM_KEYS
from areal_like.api.config import DatasetConfig as _DatasetConfig
from areal_like.api.config import TrainEngineConfig
from recipes.configs import GRPOConfig as _GRPOConfig
from recipes.configs import PPOConfig as _PPOConfig
from recipes.configs import SFTConfig as _SFTConfig


@dataclass
class _Timed:
    experiment_name: str = ""
    trial_name: str = ""
    fileroot: str = ""
    freq_epochs: Optional[int] = None
    freq_steps: Optional[int] = None
    freq_secs: Optional[int] = None


@dataclass
class SaverConfig(_Timed):
    """When `Saver` writes the model (an HF folder), under `Saver.get_save_checkpoint_root`."""


@dataclass
class EvaluatorConfig(_Timed):
    """When `Evaluator` calls the script's evaluation function."""


@dataclass
class RecoverConfig(_Timed):
    """Mapped to our `checkpoint` section (mode -> checkpoint.recover, freq_steps)."""

    mode: str = "disabled"
    retries: int = 3


@dataclass
class StatsLoggerConfig:
    """Mapped to our `logging` section (wandb.mode other than disabled -> logging.wandb)."""

    experiment_name: str = ""
    trial_name: str = ""
    fileroot: str = ""
    wandb: Dict[str, Any] = field(default_factory=dict)
    swanlab: Dict[str, Any] = field(default_factory=dict)
    tensorboard: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterSpecConfig:
    """`fileroot` is our logging.log_dir; placement is the launcher's (launcher.*)."""

    fileroot: str = "runs"
    cluster_name: str = "local"
    n_nodes: int = 1
    n_gpus_per_node: int = 1
    name_resolve: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DatasetConfig(_DatasetConfig):
    """Ours, plus the data-loader settings AReaL-lite scripts pass to `StatefulDataLoader`."""

    pin_memory: bool = False
    num_workers: int = 0
    drop_last: bool = True


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """Our train engine's config, plus AReaL-lite's `actor.path` / `dtype` and its PPO keys
    (loaded from YAML, they are our `algorithm` section's values as well)."""

    path: str = ""
    dtype: str = "float32"
    group_size: int = 1
    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    eps_clip_higher: Optional[float] = None
    c_clip: Optional[float] = None
    temperature: float = 1.0
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    overlong_reward_penalty: bool = False
    overlong_tokens: int = 0
    overlong_penalty_factor: float = 1.0
    discount: float = 1.0
    gae_lambda: float = 1.0
    kl_ctl: float = 0.0
    recompute_logprob: bool = True
    use_decoupled_loss: bool = True
    behav_imp_weight_cap: Optional[float] = None
    dynamic_sampling: bool = False

    def algorithm(self, base: Optional[AlgorithmConfig] = None) -> AlgorithmConfig:
        """`base` (default: ours) with this section's PPO keys."""
        algorithm = copy.deepcopy(base or AlgorithmConfig())
        values = {MOVED_KEYS.get(k, k): getattr(self, k) for k in ACTOR_ALGORITHM_KEYS}
        for dotted, value in {**values, "loss.eps_clip_high": self.eps_clip_higher}.items():
            *section, leaf = dotted.split(".")
            setattr(getattr(algorithm, section[0]) if section else algorithm, leaf, value)
        return algorithm


# AReaL-lite's sections redefine some of ours with its own classes (actor: PPOActorConfig, a
# TrainEngineConfig with the PPO keys; ref: optional), so each class below carries
# `type: ignore[misc]` for the redefinitions
@dataclass
class _ArealiteSections:
    experiment_name: str = "default"
    trial_name: str = "trial0"
    allocation_mode: str = ""
    cluster: ClusterSpecConfig = field(default_factory=ClusterSpecConfig)
    total_train_epochs: int = 1
    tokenizer_path: str = ""
    async_training: bool = True
    server_only: bool = False
    sglang: Dict[str, Any] = field(default_factory=dict)  # mapped: server.* (see arealite_keys)
    saver: SaverConfig = field(default_factory=SaverConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    ref: Optional[PPOActorConfig] = None  # a frozen reference: built when actor.kl_ctl > 0
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(
        default_factory=lambda: DatasetConfig(split="test", size=200, shuffle=False))


@dataclass
class GRPOConfig(_ArealiteSections, _GRPOConfig):  # type: ignore[misc]
    """AReaL-lite's GRPOConfig: our GRPO schema with AReaL-lite's sections."""


@dataclass
class PPOConfig(_ArealiteSections, _PPOConfig):  # type: ignore[misc]
    """AReaL-lite's PPOConfig (ours has a critic section too)."""


@dataclass
class SFTConfig(_ArealiteSections, _SFTConfig):  # type: ignore[misc]
    """AReaL-lite's SFTConfig."""
