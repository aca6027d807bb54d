"""AReaL-lite's public names, for code ported from it: change the imports, keep the code.

Every name here is ours under AReaL-lite's name, or a thin adapter where AReaL-lite's call
differs (the rollout engine that also runs workflows, the future-returning weight update, the
reward signature, the PPO actor as an engine, the script helpers). docs/migrating_from_arealite.md
maps each name and config key and says what behaves differently, and why.

    from areal_like.arealite import (FSDPPPOActor, LLMRequest, RemoteSGLangEngine,
                                     RolloutWorkflow, FinetuneSpec, stats_tracker, ...)
"""

from areal_like.api import (
    FinetuneSpec,
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
    SaveLoadMeta,
    TrainEngine,
)
from areal_like.api.config import (
    BaseExperimentConfig,
    OptimizerConfig,
    RolloutConfig,
    ServerConfig,
    TrainEngineConfig,
)
from areal_like.arealite.config import (
    ClusterSpecConfig,
    DatasetConfig,
    EvaluatorConfig,
    GRPOConfig,
    PPOActorConfig,
    PPOConfig,
    RecoverConfig,
    SaverConfig,
    SFTConfig,
    StatsLoggerConfig,
)
from areal_like.arealite.engines import (
    FSDPEngine,
    RemoteSGLangEngine,
    gsm8k_reward_fn,
    load_expr_config,
    load_hf_tokenizer,
)
from areal_like.arealite.training import (
    Evaluator,
    FSDPPPOActor,
    Saver,
    StatsLogger,
    WeightUpdateMeta,
    log_gpu_stats,
    seeding,
)
from areal_like.utils import stats_tracker
from areal_like.utils.batching import concat_padded as concat_padded_tensors
from areal_like.utils.packed_logprobs import gather_logprobs
from workflows import ArealOpenAI, MultiTurnWorkflow, ReMaxWorkflow, RLVRWorkflow

LLMRequest = ModelRequest
LLMResponse = ModelResponse
ReMaxRLVRWorkflow = ReMaxWorkflow
# AReaL-lite's config class names (areal/api/cli_args.py) for ours
InferenceEngineConfig = RolloutConfig
SGLangConfig = ServerConfig

__all__ = [
    "ArealOpenAI", "BaseExperimentConfig", "ClusterSpecConfig", "DatasetConfig",
    "EvaluatorConfig", "GRPOConfig", "InferenceEngineConfig", "OptimizerConfig",
    "PPOActorConfig", "PPOConfig", "RecoverConfig", "SFTConfig", "SaverConfig",
    "StatsLoggerConfig",
    "SGLangConfig", "TrainEngineConfig", "Evaluator", "FSDPEngine", "FSDPPPOActor", "FinetuneSpec",
    "GenerationHyperparameters", "InferenceEngine", "LLMRequest", "LLMResponse",
    "MultiTurnWorkflow", "RLVRWorkflow", "ReMaxRLVRWorkflow", "RemoteSGLangEngine",
    "RolloutWorkflow", "SaveLoadMeta", "Saver", "StatsLogger", "TrainEngine", "WeightUpdateMeta",
    "concat_padded_tensors", "gather_logprobs", "gsm8k_reward_fn", "load_expr_config",
    "load_hf_tokenizer", "log_gpu_stats", "seeding", "stats_tracker",
]
