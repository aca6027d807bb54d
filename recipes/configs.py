"""Top-level config schemas of the recipes (registered for YAML defaults lists)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from areal_like.api.config import (
    AlgorithmConfig,
    BaseExperimentConfig,
    ModelConfig,
    TrainEngineConfig,
)
from areal_like.api.config_checks import (
    above,
    address_list,
    at_least,
    bounded,
    check,
    check_bounds,
    choices,
    cpu_ids,
)
from areal_like.api.config_loader import register_config_dir, register_schema
from areal_like.api.preference_config import (
    DPOLossConfig,
    PreferenceDataConfig,
    RewardModelLossConfig,
)


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO family (and ReMax): the algorithm section picks estimator, loss, aggregation."""

    use_ref_model: bool = False  # frozen reference for KL (needs algorithm.kl.coef > 0)
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        # a schema may make the section optional (AReaL-lite's `ref`: absent or null, no
        # reference model)
        ref: Optional[TrainEngineConfig] = self.ref
        check("GRPOConfig", "algorithm.kl.coef",
              self.algorithm.kl.coef == 0 or self.use_ref_model, self.algorithm.kl.coef,
              "0 without a reference model (KL to it needs one: set use_ref_model=true)"
              if ref is not None else "0 without a reference model (KL to it needs one: add "
              "a `ref` section, e.g. `ref: {path: ${actor.path}}` in an AReaL-lite config)")
        check("GRPOConfig", "use_ref_model", ref is not None or not self.use_ref_model,
              self.use_ref_model, "false without a `ref` section (the reference model's)")
        if ref is None:
            return
        check("GRPOConfig", "ref.lora.rank", not ref.lora.enabled, ref.lora.rank,
              "0: the reference is frozen (with actor.lora it is the actor's own base)")
        if self.use_ref_model and not self.actor.lora.enabled:  # (LoRA: the actor's own base)
            same_layout("GRPOConfig", "ref", ref, self.actor)


@dataclass
class PPOConfig(GRPOConfig):
    """PPO with a learned critic (a value head on the LM) and GAE."""

    critic: TrainEngineConfig = field(
        default_factory=lambda: TrainEngineConfig(model=ModelConfig(is_critic=True))
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check("PPOConfig", "critic.lora.rank", not self.critic.lora.enabled,
              self.critic.lora.rank, "0: the critic's value head must train, and LoRA "
              "freezes all but the adapters (LoRA is for the actor: actor.lora.rank)")
        same_layout("PPOConfig", "critic", self.critic, self.actor)


def same_layout(cls_name: str, section: str, engine: TrainEngineConfig,
                actor: TrainEngineConfig) -> None:
    """Every engine of a recipe reads the rows the actor's layout sends each rank (a
    sequence-parallel group's ranks the same rows): their meshes must be the actor's."""
    check(cls_name, f"{section}.parallel", engine.parallel == actor.parallel, engine.parallel,
          f"the actor's layout {actor.parallel} (set {section}.parallel.* as actor.parallel.*)")


@dataclass
class PRMConfig:
    """The process reward model: a service the recipe starts, or one already running."""

    url: str = ""  # http://host:port of a running PRM service; empty: start one from model_path
    # PRM folder served by `python -m areal_like.rewards.prm_server` (token classification,
    # or a vision PRM that also reads the prompt's images: areal_like.rewards.vision_prm)
    model_path: str = ".cache/models/addition-prm"
    port: int = 0  # port of the started service; 0: a free one (binds 127.0.0.1)
    step_delimiter: str = "; "  # text that ends a reasoning step (kept with the step)
    timeout: float = 30.0  # seconds per scoring request; a late answer is a failed sample
    startup_timeout: float = 120.0  # seconds to wait for the started service's /health
    empty_reward: float = 0.0  # reward of a completion without text (it has no step)
    # divide each step score by the number of steps (total = mean score): no gain from
    # cutting text into many short steps
    average_steps: bool = False
    outcome_coef: float = 0.0  # > 0: add this x the task verifier's reward on the last token
    score_offset: float = 0.0  # step reward = PRM score - this (0.5: a doubted step costs)

    def __post_init__(self) -> None:
        if not self.step_delimiter:
            raise ValueError("PRMConfig.step_delimiter='' : set the text that ends a step")
        if self.timeout <= 0 or self.startup_timeout <= 0:
            raise ValueError(f"PRMConfig.timeout={self.timeout}, startup_timeout="
                             f"{self.startup_timeout}: both must be > 0")
        if not self.url and not self.model_path:
            raise ValueError("PRMConfig: set prm.url (a running service) or prm.model_path")


@dataclass
class PPOPRMConfig(PPOConfig):
    """PPO with a critic on process (step-level) rewards from a PRM service."""

    prm: PRMConfig = field(default_factory=PRMConfig)


@dataclass
class MultiTurnConfig(GRPOConfig):
    max_turns: int = 3
    turn_discount: float = 0.9
    feedback: str = "Your answer is wrong. Please try again."


@dataclass
class ProgramConfig:
    """The agent program the `agent_program` recipe trains (the `program:` section): run once
    per episode against the trainer's gateway (workflows/program.py)."""

    command: list[str] = field(default_factory=list)  # argv; a leading `python` is this one
    verifier: str = ""  # import path of score(item, run) -> float
    timeout_s: float = bounded(120.0, bound=above(0, " seconds"))
    turn_discount: float = 1.0
    export_style: str = bounded("concat", bound=choices("concat", "individual"))

    def __post_init__(self) -> None:
        check_bounds(self, "program")
        check("ProgramConfig", "program.command", bool(self.command), self.command,
              "the program's argv, e.g. [python, examples/calculator_agent/agent.py]")
        check("ProgramConfig", "program.verifier", bool(self.verifier), self.verifier,
              "the import path of score(item, run) -> float")
        check("ProgramConfig", "program.turn_discount", 0.0 <= self.turn_discount <= 1.0,
              self.turn_discount, "a value in [0, 1]")


@dataclass
class ProgramRecipeConfig(GRPOConfig):
    """An agent program (any command) trained through the gateway with the GRPO family."""

    program: ProgramConfig = field(default_factory=lambda: ProgramConfig(
        command=["python", "examples/calculator_agent/agent.py"],
        verifier="examples.calculator_agent.task:score"))


@dataclass
class MemoryAgentConfig:
    """The memory agent's own knobs (the `agent:` section)."""

    max_steps: int = bounded(1, bound=at_least(1))  # generated turns per chunk (each one action)
    beta: float = 0.05  # weight of memory compression (r3) in every action's reward
    gamma: float = 0.1  # weight of the action's content quality (r4)
    # retrieval (a memory lookup) | policy (untrained turns)
    answerer: str = bounded("retrieval", bound=choices("retrieval", "policy"))

    def __post_init__(self) -> None:
        check_bounds(self, "agent")


@dataclass
class AgentConfig(GRPOConfig):
    """The memory agent (Mem-alpha): tool calls build a memory, then the questions are
    answered from it; `gconfig.n_samples` rollouts per item."""

    agent: MemoryAgentConfig = field(default_factory=MemoryAgentConfig)

    # top-level keys before the `agent:` section; refused naming their place
    moved_keys = {k: f"agent.{k}" for k in ("max_steps", "beta", "gamma", "answerer")}


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation: an SGLang fleet serving a stronger model that
    shares the student's tokenizer (its log-probs are of the student's own token ids)."""

    model_path: str = ".cache/models/addition-teacher"  # HF folder the launcher serves
    # a running teacher fleet (host:port); empty: the launcher starts `n_servers` of them
    server_addrs: list[str] = field(default_factory=list)
    n_servers: int = bounded(1, bound=at_least(1))
    # cores of the started teacher servers; empty: not pinned (beside the student's servers
    # on a split machine it slowed a run by 15 %; unpinned it uses the trainer's idle time)
    cpus: list[int] = bounded(default_factory=list, bound=cpu_ids())
    use_task_reward: bool = True  # the verifier's reward too; false: the teacher's KL alone
    # seconds per scoring request; late = a failed sample
    request_timeout: float = bounded(60.0, bound=above(0))
    # > 0: also fetch the teacher's k most likely next tokens at every position, for the exact
    # per-position reverse KL in the loss (algorithm.kl.estimator=full); 0: sampled tokens only
    top_k: int = bounded(0, bound=at_least(0, " (0: no top tokens)"))

    def __post_init__(self) -> None:
        check_bounds(self, "TeacherConfig")
        check("TeacherConfig", "model_path", bool(self.model_path or self.server_addrs),
              self.model_path, "a model folder, or set teacher.server_addrs")
        if self.server_addrs:  # a running fleet: the launcher starts no teacher server
            for key, unset in (("n_servers", 1), ("cpus", [])):
                check("TeacherConfig", key, getattr(self, key) == unset, getattr(self, key),
                      f"unset ({unset!r}) with teacher.server_addrs (the launcher starts no "
                      f"teacher server; those servers were started elsewhere)")
        address_list("TeacherConfig", "server_addrs", self.server_addrs)


@dataclass
class DistillConfig(GRPOConfig):
    """On-policy distillation: the student samples, the teacher fleet scores every sampled
    token, and the teacher is the actor's KL reference: each token is rewarded
    -algorithm.kl.coef x (log p_student - log p_teacher) (kl.in_reward, k1), with the task's
    reward when teacher.use_task_reward."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def __post_init__(self) -> None:
        BaseExperimentConfig.__post_init__(self)
        check("DistillConfig", "use_ref_model", not self.use_ref_model, self.use_ref_model,
              "false: the teacher is the KL reference of distillation")
        check("DistillConfig", "algorithm.kl.coef", self.algorithm.kl.coef > 0,
              self.algorithm.kl.coef, "> 0: it weighs the teacher's per-token reward (the "
              "distill and distill_full presets set it)")
        full = self.algorithm.kl.estimator == "full"
        check("DistillConfig", "teacher.top_k", (self.teacher.top_k > 0) == full,
              self.teacher.top_k, "> 0 with algorithm.kl.estimator=full (the teacher's top-k "
              "tokens are its distribution) and 0 otherwise (nothing else reads them)")


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on (prompt, answer) pairs of a task (`train_dataset.batch_size`
    pairs per step)."""

    def __post_init__(self) -> None:
        # SFT's loss is the answer tokens' cross-entropy: an algorithm setting would be unread
        _refuse_algorithm(self.algorithm, "the sft recipe trains on the task's answers with "
                                          "cross-entropy")
        super().__post_init__()


@dataclass
class PairRecipeConfig(BaseExperimentConfig):
    """A recipe that trains on preference pairs (`pairs`, `pairs.batch_size` per step) and
    evaluates on `valid_pairs` (its first `evaluation.n_prompts`)."""

    # the task sections these recipes do not read (preflight leaves them alone)
    UNREAD_DATASETS: ClassVar[tuple[str, ...]] = ("train_dataset",)
    # a policy learns to stop (DPO: EOS is part of each response); a reward model scores the
    # text as it will be served
    RESPONSES_END_WITH_EOS: ClassVar[bool] = False
    pairs: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # trained on
    # held out: evaluated every evaluation.freq_steps (its first evaluation.n_prompts)
    valid_pairs: PreferenceDataConfig = field(default_factory=lambda: PreferenceDataConfig(
        split="test", size=200, shuffle=False))

    def __post_init__(self) -> None:
        _refuse_algorithm(self.algorithm, f"{type(self).__name__} trains on pairs with its "
                                          f"own `loss` section")
        super().__post_init__()


@dataclass
class RMConfig(PairRecipeConfig):
    """Reward-model training (Bradley-Terry): `actor` is the model with a scalar head."""

    UNREAD_DATASETS: ClassVar[tuple[str, ...]] = ("train_dataset", "valid_dataset")
    actor: TrainEngineConfig = field(
        default_factory=lambda: TrainEngineConfig(model=ModelConfig(is_critic=True)))
    loss: RewardModelLossConfig = field(default_factory=RewardModelLossConfig)

    def __post_init__(self) -> None:
        check("RMConfig", "actor.model.is_critic", self.actor.model.is_critic,
              self.actor.model.is_critic, "true: a reward model is the LM with a scalar head")
        super().__post_init__()


@dataclass
class DPOConfig(PairRecipeConfig):
    """DPO: `actor` the policy, `ref` the frozen reference (unused with actor.lora: the
    actor's own base is the reference); the reference's log-probs are computed once."""

    RESPONSES_END_WITH_EOS: ClassVar[bool] = True
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    # pairs per forward when the reference's log-probs are computed (per rank)
    ref_pairs_per_forward: int = bounded(64, bound=at_least(1))


@dataclass
class OnlineDPOConfig(GRPOConfig):
    """Online DPO: each group's samples from the fleet (the GRPO loop's rollouts) give a pair,
    its best-rewarded sample against its worst; DPO against `ref` (with actor.lora, the
    actor's own base). `algorithm.group_size` samples per prompt; the rest of `algorithm`
    is unread."""

    loss: DPOLossConfig = field(default_factory=DPOLossConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.algorithm.group_size < 2:  # no pair in a group of one: nothing would train
            raise ValueError(f"algorithm.group_size={self.algorithm.group_size}: online DPO "
                             f"pairs a prompt's best sample with its worst, so it needs at "
                             f"least 2 samples per prompt")


def _refuse_algorithm(algorithm: AlgorithmConfig, recipe: str) -> None:
    """A recipe that reads no `algorithm` setting refuses one that was set."""
    unread = _changed("algorithm", algorithm, AlgorithmConfig())
    if unread:
        raise ValueError(f"{', '.join(unread)}: {recipe} and reads no algorithm setting (the "
                         f"RL recipes do: grpo, ppo, ...); leave the algorithm section unset")


def _changed(prefix: str, value: object, default: object) -> list[str]:
    """'key=value' of every leaf where `value` differs from `default` (dataclasses)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return [] if value == default else [f"{prefix}={value!r}"]
    return [line for f in dataclasses.fields(value)
            for line in _changed(f"{prefix}.{f.name}", getattr(value, f.name),
                                 getattr(default, f.name))]


SCHEMAS = {"grpo_schema": GRPOConfig, "ppo_schema": PPOConfig,
           "ppo_prm_schema": PPOPRMConfig,
           "multi_turn_schema": MultiTurnConfig, "agent_schema": AgentConfig,
           "distill_schema": DistillConfig, "sft_schema": SFTConfig,
           "agent_program_schema": ProgramRecipeConfig, "rm_schema": RMConfig,
           "dpo_schema": DPOConfig, "online_dpo_schema": OnlineDPOConfig}
for _name, _cls in SCHEMAS.items():
    register_schema(_name, _cls)
# a user's YAML anywhere may build on the shipped ones: `defaults: [grpo_addition, _self_]`
register_config_dir(Path(__file__).resolve().parent / "conf")

# recipe name -> (config schema, default YAML in recipes/conf, needs an inference fleet)
RECIPES: dict[str, tuple[type, str, bool]] = {
    "grpo": (GRPOConfig, "grpo_addition.yaml", True),
    "remax": (GRPOConfig, "remax_addition.yaml", True),
    "ppo": (PPOConfig, "ppo_addition.yaml", True),
    "ppo_prm": (PPOPRMConfig, "ppo_prm_addition.yaml", True),
    "distill": (DistillConfig, "distill_addition.yaml", True),
    "multi_turn": (MultiTurnConfig, "multi_turn_addition.yaml", True),
    "agent": (AgentConfig, "agent_memory.yaml", True),
    "agent_program": (ProgramRecipeConfig, "agent_program_calculator.yaml", True),
    "sft": (SFTConfig, "sft_addition.yaml", False),
    "rm": (RMConfig, "rm_addition.yaml", False),
    "dpo": (DPOConfig, "dpo_addition.yaml", False),
    "online_dpo": (OnlineDPOConfig, "online_dpo_addition.yaml", True),
}
