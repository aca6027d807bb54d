"""Dataclass configs. Each recipe composes them into one top-level config (see `load_config`).

Every field has a default so a YAML file only states what differs. Types are enforced by
OmegaConf when configs are composed; value checks live in `__post_init__` and name the key.
The `algorithm` section (`AlgorithmConfig`) is defined in `algorithm_config.py`, the `reward`
section (`RewardConfig`) in `reward_config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from areal_like.api.algorithm_config import AlgorithmConfig
from areal_like.api.config_checks import (
    FRACTION,
    FRACTION_BELOW_1,
    IMPORT_PATH,
    Bound,
    above,
    at_least,
    bounded,
    check_bounds,
    choices,
    cpu_ids,
    within,
)
from areal_like.api.config_checks import check as _check
from areal_like.api.io_struct import GenerationHyperparameters
from areal_like.api.launcher_config import LauncherConfig
from areal_like.api.lora_config import LoRAConfig
from areal_like.api.lora_serving import serve_actor_lora
from areal_like.api.moe_config import MoEConfig, serve_routed_experts
from areal_like.api.parallel_config import ParallelConfig
from areal_like.api.reward_config import RewardConfig
from areal_like.api.rollout_config import BACKENDS, RolloutConfig
from areal_like.api.task_keys import ADDITION_DEFAULTS, OWN_TASK_PARAMETERS, keys_for_task
from areal_like.api.tracker_config import MLflowConfig, TrackioConfig, WandbConfig


@dataclass
class ModelConfig:
    """An HF causal LM folder (weights + tokenizer)."""

    path: str = ""
    tokenizer_path: str = ""  # empty: same as `path`
    dtype: str = bounded("float32", bound=choices("float32", "bfloat16", "float16"))
    is_critic: bool = False  # replace the LM head with a scalar value head
    # keyword arguments of the chat template, e.g. {enable_thinking: false} (Qwen3)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_bounds(self, "ModelConfig")


@dataclass
class OptimizerConfig:
    type: str = bounded("adamw", bound=choices("adamw"))
    lr: float = bounded(1e-5, bound=at_least(0))
    weight_decay: float = bounded(0.0, bound=at_least(0))
    beta1: float = bounded(0.9, bound=FRACTION_BELOW_1)
    beta2: float = bounded(0.999, bound=FRACTION_BELOW_1)
    eps: float = bounded(1e-8, bound=above(0))
    lr_scheduler_type: str = bounded("constant", bound=choices("constant", "linear", "cosine"))
    warmup_steps_proportion: float = bounded(0.0, bound=FRACTION)
    # cosine/linear decay floor, as a fraction of `lr`
    min_lr_ratio: float = bounded(0.0, bound=FRACTION)
    gradient_clipping: float = bounded(1.0, bound=at_least(0, " (0: off)"))

    def __post_init__(self) -> None:
        check_bounds(self, "OptimizerConfig")


@dataclass
class MicroBatchSpec:
    """How a batch is split: by a token budget per micro-batch (first-fit-decreasing)."""

    max_tokens_per_mb: int = bounded(4096, bound=at_least(1))
    n_mbs: int = bounded(1, bound=at_least(1))  # minimum number of micro-batches
    # what the split of a batch's rows over data-parallel ranks equalises: "compute" (tokens
    # plus each sequence's attention, which grows with its length squared: a long-tail batch's
    # long answers count for more) or "tokens" (engines/fsdp/packing.py: sequence_costs)
    balance: str = bounded("compute", bound=choices("compute", "tokens"))

    def __post_init__(self) -> None:
        check_bounds(self, "MicroBatchSpec")

@dataclass
class TrainEngineConfig:
    """An FSDP2-trained model: what to load, how to shard, how to optimise."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    # "bfloat16" turns on FSDP2 mixed precision
    param_dtype: str = bounded("float32", bound=choices("float32", "bfloat16"))
    reduce_dtype: str = bounded("float32", bound=choices("float32", "bfloat16"))
    # recompute checkpointed decoder layers' activations in the backward instead of keeping them
    gradient_checkpointing: bool = False
    # which layers: every N-th (1: all; 2: every other one, half the recompute and the saving)
    gradient_checkpointing_every: int = bounded(1, bound=at_least(1))
    # CUDA: what checkpointed layers keep for their recompute (their inputs) in host memory
    activation_offload: bool = False
    # CUDA: parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy;
    # the optimizer steps on the CPU)
    cpu_offload: bool = False
    # auto: nccl on CUDA, gloo on CPU
    backend: str = bounded("auto", bound=choices("auto", "gloo", "nccl"))
    # bound on every collective of the trainer's process group (a dead peer becomes an error)
    collective_timeout: float = bounded(600.0, bound=above(0, " seconds"))
    # for LR schedules; 0: set by the recipe
    total_train_steps: int = bounded(0, bound=at_least(0, " (0: set by the recipe)"))
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train adapters only
    # a VLM's vision tower (patch embedding, blocks, merger) takes no gradient
    freeze_vision_tower: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)  # a mixture of experts' routers
    # each shared prefix (a group's prompt, a history) forwarded once: engines/fsdp/shared_prefix.py
    shared_prefix: bool = False
    # the trainer's device mesh: sequence (Ulysses) x tensor parallel sizes, data the rest
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_bounds(self, "TrainEngineConfig")
        for key in ("gradient_checkpointing_every", "activation_offload"):
            value = getattr(self, key)
            _check("TrainEngineConfig", key, self.gradient_checkpointing
                   or value == getattr(TrainEngineConfig, key), value,
                   "unset without gradient_checkpointing=true (it tunes the checkpointed "
                   "layers)")


@dataclass
class ServerConfig:
    """How the local launcher starts inference servers (ignored when attaching to a fleet,
    except `backend`, which the client follows unless rollout.backend is set)."""

    # sglang | vllm (docs/deployment.md: what each provides)
    backend: str = bounded("sglang", bound=choices(*BACKENDS))
    n_servers: int = bounded(1, bound=at_least(1))
    device: str = bounded("cpu", bound=choices("cpu", "cuda"))
    venv: str = ""  # the backend's own virtual environment; empty: .venv-sglang / .venv-vllm
    dtype: str = bounded("float32", bound=choices("float32", "bfloat16", "float16", "auto"))
    max_total_tokens: int = 65536  # checked: >= context_length
    # CPU: free memory that may vanish while the weights load (others allocate) before the
    # server refuses to start; its KV cache is sized by max_total_tokens
    mem_fraction_static: float = bounded(0.5, bound=Bound("in (0, 1]", lambda v: 0.0 < v <= 1.0))
    context_length: int = bounded(1024, bound=at_least(1, " tokens"))
    threads_per_server: int = bounded(1, bound=at_least(1))
    # CUDA: each server gets its own slice of the visible GPUs (TP)
    gpus_per_server: int = bounded(1, bound=at_least(1))
    deterministic: bool = True  # seeded, batch-invariant sampling (see api/seeding.py)
    # CPU SGLang: each server forked from one interpreter that imported SGLang once, and its
    # scheduler + detokenizer forked from it, not spawned (no re-import: engines/fleet/zygote.py)
    fork_children: bool = False
    startup_timeout: float = bounded(300.0, bound=above(0, " seconds"))
    # how long the server's /health_generate waits for one generated token before it answers
    # "not generating" (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT): how soon a hung scheduler is found
    health_generate_timeout: int = bounded(20, bound=at_least(1, " second"))
    # per server: the launcher restarts a dead server this many times
    max_restarts: int = bounded(3, bound=at_least(0))
    # Niceness (0-19) of the server processes. Where they share cores with the trainer, a
    # positive value lets the trainer (the critical path) run first; rollouts fill the gaps.
    nice: int = bounded(0, bound=within(0, 19))
    # CPU ids the servers (and the scheduler/detokenizer they start) run on; empty: any
    # the servers' share of the cores, as GPUs are their share on a GPU machine
    cpus: List[int] = bounded(default_factory=list, bound=cpu_ids())
    # LoRA serving: the largest adapter rank (filled from actor.lora)
    lora_rank: int = bounded(0, bound=at_least(0, " (0: no LoRA)"))
    # LoRA serving: the modules adapted (filled from actor.lora.target_modules)
    lora_target_modules: List[str] = field(default_factory=list)
    extra_args: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_bounds(self, "ServerConfig")
        _check("ServerConfig", "max_total_tokens", self.max_total_tokens >= self.context_length,
               self.max_total_tokens, f">= context_length={self.context_length}")


SGLangServerConfig = ServerConfig  # the old name (it configures vLLM servers too)


@dataclass
class DatasetConfig:
    """A task: `addition` (procedural), `gsm8k` (local JSONL/parquet), `memory_agent`
    (procedural agent episodes; `memory_agent_demos`: SFT demonstrations of its tool-call
    format), `reasoning_gym:<name>`."""

    type: str = "addition"
    path: str = ""  # for gsm8k: a .jsonl / .parquet file
    split: str = "train"
    size: int = 10000  # number of items (gsm8k: 0 = every row of the file)
    seed: int = 1
    batch_size: int = bounded(8, bound=at_least(1))  # prompts per rollout batch
    shuffle: bool = True
    # tokens of an item's `messages`, chat template included
    max_prompt_len: int = bounded(512, bound=at_least(1))
    # drop (counted and logged) | error
    on_long_prompt: str = bounded("drop", bound=choices("drop", "error"))
    # Parameters of the task's generator: reasoning-gym's dataset config fields (e.g.
    # {min_terms: 2, max_terms: 2, max_digits: 1}); addition: num_digits (digits per operand,
    # 2), worked_fraction (share of SFT targets written out column by column, 0); your own
    # task function's keyword arguments.
    task_kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        own = bool(IMPORT_PATH.match(self.type))
        ok = self.type in OWN_TASK_PARAMETERS or own
        _check("DatasetConfig", "type", ok, self.type,
               ", ".join(repr(t) for t in OWN_TASK_PARAMETERS) + ", "
               "'reasoning_gym:<task name>' or the "
               "import path of your own task function, 'my_pkg.tasks:make_task'")
        _check("DatasetConfig", "size", self.size >= 1 or (self.type == "gsm8k" and self.size == 0),
               self.size, ">= 1 (0 = every row, for type=gsm8k only)")
        check_bounds(self, "DatasetConfig")
        _check("DatasetConfig", "path", bool(self.path) == (self.type == "gsm8k"), self.path,
               "a .jsonl or .parquet file for type=gsm8k" if self.type == "gsm8k" else
               f"unset: only type=gsm8k reads a file, not {self.type!r}")
        if self.type in OWN_TASK_PARAMETERS:  # others: checked by the task
            accepted = OWN_TASK_PARAMETERS[self.type]
            unknown = sorted(set(self.task_kwargs) - set(accepted))
            _check("DatasetConfig", "task_kwargs", not unknown, dict(self.task_kwargs),
                   f"parameters of task {self.type!r}: {list(accepted)} (not {unknown})")
        if self.type == "addition":
            digits = self.task_kwargs.get("num_digits", ADDITION_DEFAULTS["num_digits"])
            worked = self.task_kwargs.get("worked_fraction",
                                          ADDITION_DEFAULTS["worked_fraction"])
            _check("DatasetConfig", "task_kwargs.num_digits",
                   isinstance(digits, int) and 1 <= digits <= 18, digits, "an integer in 1..18")
            _check("DatasetConfig", "task_kwargs.worked_fraction",
                   isinstance(worked, (int, float)) and 0.0 <= worked <= 1.0, worked, "in [0, 1]")

    @classmethod
    def suggestable_keys(cls, task_type: Any) -> tuple[list[str], list[str]]:
        """For a typo's hint: the keys valid for `task_type` (fields, task_kwargs)."""
        return keys_for_task(list(cls.__dataclass_fields__), task_type)


@dataclass
class CheckpointConfig:
    save_dir: str = ""  # empty: <log_dir>/checkpoints
    freq_steps: int = bounded(0, bound=at_least(0, " (0: off)"))
    keep_last: int = bounded(2, bound=at_least(1))
    # disabled | auto (resume when a checkpoint exists)
    recover: str = bounded("disabled", bound=choices("disabled", "auto"))
    # the train state (DCP) is copied to host memory and written beside the next steps; the
    # checkpoint counts (`latest`) at the first step end that finds every rank's write done (a
    # run killed before resumes from the one before). Costs one host copy of the sharded
    # model and optimizer state while it writes.
    async_save: bool = False

    def __post_init__(self) -> None:
        check_bounds(self, "CheckpointConfig")


@dataclass
class EvaluationConfig:
    freq_steps: int = bounded(0, bound=at_least(0, " (0: off)"))
    n_prompts: int = bounded(100, bound=at_least(1))
    # >1: also report pass@k and pass@1 from sampled answers
    pass_k: int = bounded(1, bound=at_least(1))
    pass_n: int = 0  # samples per prompt for pass@k (>= pass_k; 0: pass_k); unbiased estimate
    # for pass@k samples (accuracy is always greedy)
    temperature: float = bounded(1.0, bound=above(0))
    # what scores held-out answers: "training" (what training's rewards use: reward.fn or
    # reward.remote_rm_url when set) | "task" (the task's own verifier, even then: a learned
    # reward model is judged by what it stands for)
    verifier: str = bounded("training", bound=choices("training", "task"))

    def __post_init__(self) -> None:
        check_bounds(self, "EvaluationConfig")
        _check("EvaluationConfig", "pass_n", self.pass_n == 0 or self.pass_n >= self.pass_k,
               self.pass_n, "0 or >= pass_k")


@dataclass
class LoggingConfig:
    experiment_name: str = "default"
    trial_name: str = "trial0"
    log_dir: str = "runs"  # files go to <log_dir>/<experiment_name>/<trial_name>
    console: bool = True
    # steps between console metric lines (plus the first, the last and every evaluation);
    # 0: about 50 lines per run. Every step still goes to the files.
    console_every: int = bounded(0, bound=at_least(0, " (0: about 50 lines per run)"))
    jsonl: bool = True
    tensorboard: bool = True
    plot: bool = True
    # experiment trackers (areal_like/api/tracker_config.py): every step's metrics go to each
    # one enabled, from a thread of its own, so a slow or dead tracker never holds training
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    trackio: TrackioConfig = field(default_factory=TrackioConfig)
    # how long the end of a run waits for the trackers to take what is still queued
    trackers_close_timeout_s: float = bounded(60.0, bound=above(0))

    def __post_init__(self) -> None:
        check_bounds(self, "LoggingConfig")


@dataclass
class BaseExperimentConfig:
    """Fields every recipe shares; recipes subclass it to add their own sections."""

    seed: int = 1
    total_train_steps: int = 100
    model: ModelConfig = field(default_factory=ModelConfig)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(
        default_factory=lambda: DatasetConfig(split="test", size=200, shuffle=False)
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self) -> None:
        _check("BaseExperimentConfig", "total_train_steps", self.total_train_steps >= 0,
               self.total_train_steps, ">= 0")
        resolve_algorithm(self.algorithm, self.gconfig, self.rollout)
        if not self.rollout.backend:
            self.rollout.backend = self.server.backend
        elif not self.rollout.server_addrs and self.rollout.backend != self.server.backend:
            raise ValueError(f"rollout.backend={self.rollout.backend} but the launcher starts "
                             f"server.backend={self.server.backend} servers: set server.backend "
                             f"(rollout.backend is for attaching to a running fleet)")
        serve_actor_lora(self.actor.lora, self.server, self.rollout)
        serve_routed_experts(self.actor.moe, self.server, self.rollout)
        _check("RolloutConfig", "weights.transport",
               not (self.rollout.weights.transport == "delta" and self.actor.lora.enabled),
               self.rollout.weights.transport, "disk or distributed with actor.lora (a LoRA run "
               "sends only its adapter; delta is for whole weights)")
        if not self.rollout.server_addrs:  # the launcher starts the servers with this context
            need = self.train_dataset.max_prompt_len + self.gconfig.max_new_tokens
            _check("ServerConfig", "context_length", self.server.context_length >= need,
                   self.server.context_length,
                   f">= train_dataset.max_prompt_len + gconfig.max_new_tokens = {need}")


def resolve_algorithm(algo: AlgorithmConfig, gconfig: GenerationHyperparameters,
                      rollout: RolloutConfig) -> None:
    """Fill the algorithm's settings that follow from generation (in place) and check the
    settings that must agree across sections; errors name every key involved."""
    if algo.loss.agg_constant is None:
        algo.loss.agg_constant = float(gconfig.max_new_tokens)  # Dr.GRPO: the token budget
    shaping = algo.shaping
    if shaping.max_response_tokens not in (0, gconfig.max_new_tokens) \
            and not shaping.overlong_penalty:  # (the budget: filled in by an earlier pass)
        _check("algorithm.shaping", "max_response_tokens", False, shaping.max_response_tokens,
               "0 (unset) with overlong_penalty=false, which is the only reader of it")
    if shaping.max_response_tokens == 0:
        shaping.max_response_tokens = gconfig.max_new_tokens
    if shaping.overlong_penalty:
        _check("algorithm.shaping", "max_response_tokens",
               shaping.max_response_tokens <= gconfig.max_new_tokens, shaping.max_response_tokens,
               f"<= gconfig.max_new_tokens={gconfig.max_new_tokens} (no answer is longer, so "
               f"the penalty interval would never be reached)")
        if shaping.overlong_tokens == 0:  # a preset's buffer follows the recipe's budget
            shaping.overlong_tokens = max(1, round(shaping.max_response_tokens / 5))
        _check("algorithm.shaping", "overlong_tokens",
               0 < shaping.overlong_tokens <= shaping.max_response_tokens, shaping.overlong_tokens,
               f"in (0, max_response_tokens={shaping.max_response_tokens}] when "
               f"overlong_penalty is on")
    groups = algo.group_size > 1 or gconfig.n_samples > 1
    for key in ("dynamic_sampling", "clip_filter_weight"):
        if getattr(algo.filters, key) and not groups:
            raise ValueError(
                f"algorithm.filters.{key}=true compares the samples of one prompt, but "
                f"gconfig.n_samples=1: every group has one sample (no reward variance"
                f"{', so every group would be rejected' if key == 'dynamic_sampling' else ''}); "
                f"set gconfig.n_samples (and algorithm.group_size) >= 2")
    if not gconfig.greedy and algo.temperature != gconfig.temperature:
        raise ValueError(
            f"algorithm.temperature={algo.temperature} differs from gconfig.temperature="
            f"{gconfig.temperature}: log-probabilities must be computed at the temperature "
            f"the rollouts were sampled with; set both to the same value"
        )
    if algo.group_size not in (1, gconfig.n_samples):
        raise ValueError(
            f"algorithm.group_size={algo.group_size} disagrees with gconfig.n_samples="
            f"{gconfig.n_samples} (samples per prompt): set group_size to n_samples (or 1 when "
            f"batches carry a group_id)"
        )
    if rollout.staleness.max_head_offpolicyness > 0 and not algo.off_policy.decoupled:
        raise ValueError(
            "rollout.staleness.max_head_offpolicyness="
            f"{rollout.staleness.max_head_offpolicyness} lets rollouts be "
            f"generated by policies up to that many versions old, but "
            f"algorithm.off_policy.decoupled=false would train on them without the off-policy "
            f"correction; set algorithm.off_policy.decoupled=true (with "
            "algorithm.off_policy.recompute_logprob=true) or "
            "rollout.staleness.max_head_offpolicyness=0"
        )
