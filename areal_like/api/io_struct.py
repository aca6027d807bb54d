"""Plain data types that travel between workflows, inference engines and trainers."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Any, List, Literal, Optional

if TYPE_CHECKING:  # (torch is not imported by the contracts' module itself)
    import torch

StopReason = Literal["stop", "length", "abort", "tool_call"]
STOP_REASONS: tuple[str, ...] = ("stop", "length", "abort", "tool_call")


@dataclass
class GenerationHyperparameters:
    """Sampling settings for one request (also the `gconfig` section of a recipe config).

    `top_k = -1` disables top-k; `greedy = True` overrides temperature/top-p/top-k.
    `stop_token_ids` end generation on any of these ids (the preferred way: token ids
    never depend on a tokenizer's text round-trip); `stop` lists stop strings.
    """

    n_samples: int = 1
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: List[int] = field(default_factory=list)
    stop: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        checks = [
            ("n_samples", self.n_samples >= 1, ">= 1"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens,
             "between 0 and max_new_tokens"),
            ("temperature", self.temperature >= 0.0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"GenerationHyperparameters.{name}={getattr(self, name)!r} is invalid: "
                    f"expected {expected}"
                )

    def new(self, **changes: Any) -> GenerationHyperparameters:
        """A copy with `changes` applied; an unknown field name is an error."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(
                f"GenerationHyperparameters has no field(s) {unknown}; valid: {sorted(known)}"
            )
        return dataclasses.replace(self, **changes)


@dataclass
class ModelRequest:
    """One generation request, token-in: `input_ids` are sent as ids, never re-tokenized.

    `seed` fixes the sampling; leave it None inside workflows: the executor then derives it
    from the run seed and the episode (see `areal_like.api.seeding`).
    `image_data`: the prompt's images as base64 PNGs, one per image pad token in `input_ids`
    (`areal_like.models.vision.VisionProcessor` builds both).
    `lora_adapter`: the LoRA adapter, among several the servers hold, that serves this
    request ("" : the fleet's own weights, or its one adapter, `rollout.lora_adapter`).
    """

    input_ids: List[int]
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    seed: Optional[int] = None
    image_data: List[str] = field(default_factory=list)
    lora_adapter: str = ""

    def __post_init__(self) -> None:
        ids = self.input_ids
        if isinstance(ids, Mapping):  # transformers >= 5: apply_chat_template's default
            raise TypeError(
                f"ModelRequest(rid={self.rid!r}): input_ids is a {type(ids).__name__} with keys "
                f"{list(ids)}, not a list of token ids; tokenizer.apply_chat_template("
                f"..., tokenize=True) returns a dict in transformers >= 5: pass "
                f"return_dict=False (or take its ['input_ids'])")
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, Integral)
                    or isinstance(t, bool)), None) if isinstance(ids, (list, tuple)) else -1
        if bad is not None:
            what = (f"{type(ids).__name__}" if bad == -1
                    else f"list whose item {bad} is {ids[bad]!r}")
            raise TypeError(f"ModelRequest(rid={self.rid!r}): input_ids must be a list of int "
                            f"token ids; got a {what}")
        bad_image = next((i for i, d in enumerate(self.image_data) if not isinstance(d, str)),
                         None)
        if bad_image is not None:
            raise TypeError(f"ModelRequest(rid={self.rid!r}): image_data[{bad_image}] is a "
                            f"{type(self.image_data[bad_image]).__name__}; expected a base64 "
                            f"string (areal_like.models.vision.encode_image)")

    def copy(self, **changes: Any) -> ModelRequest:
        return dataclasses.replace(self, **changes)


@dataclass
class ModelResponse:
    """The result of one request. `output_versions[i]` is the policy version that produced
    `output_tokens[i]` (as reported by the server), so every token can be aged exactly."""

    input_tokens: List[int]
    output_tokens: List[int]
    output_logprobs: List[float]
    output_versions: List[int]
    stop_reason: StopReason = "stop"
    latency: float = 0.0
    ttft: float = 0.0
    rid: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # a mixture of experts' routing, asked with rollout.return_routed_experts: a tensor
    # [input_len + output_len, n_moe_layers * top_k] of the experts the server routed each
    # position to (its last row NO_EXPERT: the last token is never forwarded)
    routed_experts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        n = len(self.output_tokens)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"ModelResponse(rid={self.rid!r}): output_tokens has {n} entries but "
                f"output_logprobs has {len(self.output_logprobs)} and output_versions has "
                f"{len(self.output_versions)}; expected one of each per output token"
            )
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(
                f"ModelResponse.stop_reason={self.stop_reason!r}; expected one of {STOP_REASONS}"
            )

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1}


@dataclass
class TokenScores:
    """One scored sequence (`InferenceEngine.ascore_top_batch`): per scored position t, the
    log-prob of the given token, and the k most likely tokens' ids and log-probs (most likely
    first; empty without top-k)."""

    logprobs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of a weight bucket, as a server allocates it before the bytes arrive."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix ("float32")
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"ParamSpec {self.name!r}: dtype {self.dtype!r} is not one of "
                             f"{sorted(_ITEMSIZE)}")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.itemsize


@dataclass
class AdapterWeights:
    """A LoRA adapter in memory: its PEFT `adapter_config.json` as a dict, and its tensors
    under PEFT's saved names (`base_model.model.<module>.lora_A.weight`, ...)."""

    config: dict[str, Any]
    tensors: dict[str, Any]  # name -> CPU torch.Tensor (torch is not imported by the API)

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())


@dataclass
class WeightUpdateMeta:
    """How new weights reach the inference fleet, and the version they carry.

    `type="disk"`: the trainer writes an HF folder at `path` (with LoRA: the adapter's PEFT
    folder); servers load it from there.
    `type="distributed"`: trainer rank 0 broadcasts the weights over the process group
    `group_name` that it and the servers joined, one flattened bucket per entry of `buckets`
    (names, dtypes, shapes in order); the last bucket carries the version label.
    `type="adapter"`: a LoRA adapter sent in memory (`adapter`), no folder.
    `type="delta"`: trainer rank 0 wrote a weight file at `path` (engines/weight_transport/
    delta/): the tensors that changed since `base_version`, or every tensor (`base_version`
    None); a server that does not hold that base gets a full file instead.
    """

    version: int
    path: Optional[str] = None
    type: Literal["disk", "distributed", "adapter", "delta"] = "disk"
    buckets: tuple[tuple[ParamSpec, ...], ...] = ()
    group_name: str = ""
    adapter: Optional[AdapterWeights] = field(default=None, repr=False)
    base_version: Optional[int] = None  # delta: the version the file is a delta against
    base_state_digest: str = ""  # delta: the digest of that version's whole state

    @property
    def driven_by_trainer(self) -> bool:
        """Servers out of service get these weights at the trainer's next update, not from
        the rollout controller (there is no folder to load)."""
        return self.type in ("distributed", "delta")

    def __post_init__(self) -> None:
        if self.type in ("disk", "delta") and not self.path:
            raise ValueError(f"WeightUpdateMeta(type={self.type!r}) needs a `path`")
        if self.type == "distributed" and not (self.buckets and self.group_name):
            raise ValueError("WeightUpdateMeta(type='distributed') needs `buckets` and a "
                             "`group_name`")
        if self.type == "adapter" and self.adapter is None:
            raise ValueError("WeightUpdateMeta(type='adapter') needs the `adapter`")
        if self.type not in ("disk", "distributed", "adapter", "delta"):
            raise ValueError(f"WeightUpdateMeta.type={self.type!r}: use 'disk', "
                             f"'distributed', 'adapter' or 'delta'")
        if self.version < 0:
            raise ValueError(f"WeightUpdateMeta.version={self.version} must be >= 0")

    @classmethod
    def from_disk(cls, path: str, version: int) -> WeightUpdateMeta:
        return cls(version=version, path=path, type="disk")

    @classmethod
    def from_distributed(cls, buckets: list[list[ParamSpec]], group_name: str,
                         version: int) -> WeightUpdateMeta:
        return cls(version=version, type="distributed", group_name=group_name,
                   buckets=tuple(tuple(b) for b in buckets))

    @classmethod
    def from_delta(cls, path: str, version: int, base_version: Optional[int],
                   base_state_digest: str) -> WeightUpdateMeta:
        return cls(version=version, path=path, type="delta", base_version=base_version,
                   base_state_digest=base_state_digest)

    @classmethod
    def from_adapter(cls, adapter: AdapterWeights, version: int) -> WeightUpdateMeta:
        return cls(version=version, type="adapter", adapter=adapter)


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where the servers meet trainer rank 0: one TCP store at `master_addr:master_port`,
    one process group per server, named `group_name` + a per-server suffix."""

    group_name: str
    master_addr: str
    master_port: int
    backend: str  # gloo | nccl
    timeout_s: float


@dataclass(frozen=True)
class WeightGroupLayout:
    """The servers that receive the next broadcast (`members`), and those among them that
    join a new group now: (address, group name, world size = 1 + its tensor-parallel
    ranks; the trainer is rank 0 of each)."""

    members: tuple[str, ...]
    joining: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class FleetView:
    """The fleet as its client sees it when a weight update that someone else drives begins
    (`FleetClient.begin_weight_update`): the servers to update, those that join the
    distributed transport's groups at this update, and why the others are out."""

    version: int  # the version the update loads
    in_service: tuple[str, ...]
    awaiting_broadcast: tuple[str, ...] = ()
    out_of_service: str = "none"  # described, for messages


@dataclass
class UpdateReport:
    """What a driven weight update did (`FleetClient.end_weight_update`): the servers that
    now serve `meta`, those that failed (and why), and whether the fleet's version moved to
    `meta.version` (servers out of service then load it before they serve again)."""

    meta: WeightUpdateMeta
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    advanced: bool = False


@dataclass
class SaveLoadMeta:
    """What `TrainEngine.save/load` writes or reads.

    `weight_format="hf"`: an HF folder of safetensors (+ tokenizer when given), for inference
    and release. `weight_format="dcp"`: the full training state (model, optimizer, scheduler,
    RNG, version) through torch distributed checkpointing, for exact resume.
    """

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer: Any = None
    # dcp: return once the state is copied to host memory; the write goes on beside training
    # until `TrainEngine.wait_for_saves` (DCP async_save)
    async_save: bool = False


@dataclass
class FinetuneSpec:
    """How long a run trains (AReaL-lite's name): engines size their LR schedule from it."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    def __post_init__(self) -> None:
        for name in ("total_train_epochs", "dataset_size", "train_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"FinetuneSpec.{name}={getattr(self, name)!r} is invalid: "
                                 f"expected >= 1")

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch
