"""The `rollout` section, by concern: where the servers are (top level), how the client talks
to them (`client`), how far rollout runs ahead (`staleness`), when a server counts as down
(`health`), the rollout controller's process (`controller`) and how weights reach the fleet
(`weights`). Each key's range is declared beside it (`bounded`); an old flat key is refused
naming its new place (`ROLLOUT_MOVED_KEYS`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from areal_like.api.config_checks import (
    IMPORT_PATH,
    above,
    at_least,
    bounded,
    check,
    check_bounds,
    choices,
    cpu_ids,
    nonempty,
    within,
)
from areal_like.api.config_checks import address_list as _address_list

BACKENDS = ("sglang", "vllm")  # the inference servers a fleet can run


@dataclass
class FleetClientConfig:
    """How the client talks to the servers: time-outs, retries, routing, pauses."""

    api_key: Optional[str] = None  # sent as a bearer token to every server
    request_timeout: float = bounded(120.0, bound=above(0, " seconds"))
    request_retries: int = bounded(3, bound=at_least(1))
    retry_backoff: float = bounded(0.5, bound=at_least(0, " seconds"))
    setup_timeout: float = bounded(120.0, bound=above(0, " seconds"))  # servers healthy at start
    schedule_policy: str = bounded("least_inflight",
                                   bound=choices("least_inflight", "round_robin"))
    # how a server is paused for a weight load: "retract" keeps the requests in flight
    pause_mode: str = bounded("retract", bound=choices("retract", "abort", "in_place"))
    # requests asked for within this many ms of each other go to a server as one batched
    # request (SGLang; each sample keeps its rid and seed; engines/fleet/coalescing.py);
    # 0: one request per prompt
    batch_window_ms: float = bounded(0.0, bound=at_least(0, " ms"))

    def __post_init__(self) -> None:
        check_bounds(self, "rollout.client")


@dataclass
class StalenessConfig:
    """How far rollout runs ahead of training, and how much of it at once."""

    max_head_offpolicyness: int = bounded(0, bound=at_least(0))  # eta: versions ahead
    consumer_batch_size: int = bounded(8, bound=at_least(1))  # groups per training step
    max_concurrent_rollouts: int = bounded(32, bound=at_least(1))
    queue_size: int = bounded(0, bound=at_least(0, " (0: unbounded)"))

    def __post_init__(self) -> None:
        check_bounds(self, "rollout.staleness")


@dataclass
class HealthConfig:
    """A server that dies, hangs or fails a weight update leaves service; it comes back after
    loading the current weights. The run stops when fewer than min_servers are in service for
    server_down_timeout seconds (long enough for the launcher to restart one)."""

    min_servers: int = bounded(1, bound=at_least(1))
    server_down_timeout: float = bounded(300.0, bound=above(0, " seconds"))
    check_interval: float = bounded(2.0, bound=above(0, " seconds"))  # probes of servers out
    # a vLLM server that emits no token of a one-token probe within this long is hung; an
    # SGLang server bounds its own probe, server.health_generate_timeout
    generation_probe_timeout: float = bounded(20.0, bound=above(0, " seconds"))
    # a server removed from server_addrs_file gets no new request and leaves once its
    # requests in flight end, or after this long (what is left is retried on the others)
    drain_timeout: float = bounded(300.0, bound=above(0, " seconds"))

    def __post_init__(self) -> None:
        check_bounds(self, "rollout.health")


@dataclass
class ControllerProcessConfig:
    """The rollout controller process and its reward workers."""

    # niceness (see server.nice): a positive value yields the cores to the trainer first
    nice: int = bounded(0, bound=within(0, 19))
    cpus: List[int] = bounded(default_factory=list, bound=cpu_ids())  # empty: the trainer's

    def __post_init__(self) -> None:
        check_bounds(self, "rollout.controller")


@dataclass
class WeightTransportConfig:
    """How weights reach the fleet: "disk" (an HF folder every server reads), "distributed"
    (trainer rank 0 broadcasts them over a process group the servers join; no shared disk),
    or "delta" (rank 0 writes only the bytes that changed since the fleet's version to a
    shared directory; a server without that base gets the full version)."""

    transport: str = bounded("disk", bound=choices("disk", "distributed", "delta"))
    update_timeout: float = bounded(300.0, bound=above(0, " seconds"))
    bucket_mb: float = bounded(256.0, bound=above(0))  # distributed: MB gathered and sent at once
    group_backend: str = bounded("auto", bound=choices("auto", "gloo", "nccl"))  # auto: nccl on GPU
    # distributed: trainer rank 0's address, as the servers see it
    group_addr: str = bounded("127.0.0.1",
                              bound=nonempty("a host name or IP address the servers can reach"))
    # distributed: the group's collective timeout; a server that dies mid-broadcast ends the
    # update after at most this long (a bucket must reach every server within it)
    broadcast_timeout: float = bounded(120.0, bound=above(0, " seconds"))
    # distributed: after a failed broadcast, "retry" once with the servers that still answer,
    # or "stop" the run
    on_broadcast_failure: str = bounded("retry", bound=choices("retry", "stop"))
    # the servers load version k while the trainer trains step k (rank 0's updater thread;
    # the trainer waits for it before its next export, an evaluation, a checkpoint, the
    # end): the load's pause, read and continue off the trainer's path. Applies to the disk
    # transport at staleness.max_head_offpolicyness >= 1; elsewhere (a broadcast needs every
    # rank; at eta = 0 the next batch needs the new version) the load stays in the step
    overlap_load: bool = False
    # delta: how a changed tensor is written: "xor" (its bytes XOR the base's) or "sparse"
    # (indices and new values of the changed elements); then zstd at delta_zstd_level
    delta_codec: str = bounded("xor", bound=choices("xor", "sparse"))
    delta_zstd_level: int = bounded(1, bound=within(1, 22))  # 3: ~5x the time, ~1 % smaller
    # delta: every server reports a digest of its own parameters after each load (parity
    # checks: costs a pass over the weights per load)
    delta_model_digest: bool = False

    def __post_init__(self) -> None:
        check_bounds(self, "rollout.weights")


# every key of the old flat section -> its place now (under `rollout.`)
ROLLOUT_MOVED_KEYS: dict[str, str] = {
    **{k: f"client.{k}" for k in ("api_key", "request_timeout", "request_retries",
                                  "retry_backoff", "setup_timeout", "schedule_policy",
                                  "pause_mode")},
    **{k: f"staleness.{k}" for k in ("max_head_offpolicyness", "consumer_batch_size",
                                     "max_concurrent_rollouts", "queue_size")},
    "min_servers": "health.min_servers", "server_down_timeout": "health.server_down_timeout",
    "health_check_interval": "health.check_interval",
    "generation_probe_timeout": "health.generation_probe_timeout",
    "controller_nice": "controller.nice", "controller_cpus": "controller.cpus",
    "weight_transport": "weights.transport", "weight_update_timeout": "weights.update_timeout",
    "weight_bucket_mb": "weights.bucket_mb", "weight_group_backend": "weights.group_backend",
    "weight_group_addr": "weights.group_addr",
    "weight_broadcast_timeout": "weights.broadcast_timeout",
    "on_weight_broadcast_failure": "weights.on_broadcast_failure",
}


@dataclass
class RolloutConfig:
    """The rollout side: where the servers are, and one section per concern."""

    server_addrs: List[str] = field(default_factory=list)  # host:port; empty: launch locally
    server_addrs_file: str = ""  # host:port per line, re-read: servers added there join
    # the fleet's: sglang | vllm; empty: server.backend (a bare client: sglang)
    backend: str = bounded("", bound=choices("", *BACKENDS))
    # Import path of your own workflow class, 'my_pkg.flows:MyWorkflow', built as
    # cls(reward_fn, gconfig, tokenizer) by the RLVR recipes (grpo, ppo); empty: theirs.
    workflow: str = ""
    # the LoRA adapter every request names (set from actor.lora); empty: the base weights
    lora_adapter: str = ""
    # a mixture of experts: every reply carries the experts the server routed each token to,
    # and trajectories their `routed_experts` (router replay: actor.moe.router_replay)
    return_routed_experts: bool = False
    seed: Optional[int] = None  # of all sampling; None: the recipe's seed (bare engine: random)
    # the policy's vocabulary: a server joining a running fleet must have it (0: unchecked; a
    # recipe sets it from the model's config.json)
    vocab_size: int = bounded(0, bound=at_least(0))
    client: FleetClientConfig = field(default_factory=FleetClientConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    controller: ControllerProcessConfig = field(default_factory=ControllerProcessConfig)
    weights: WeightTransportConfig = field(default_factory=WeightTransportConfig)

    moved_keys = ROLLOUT_MOVED_KEYS  # an old flat key is refused naming its place

    def __post_init__(self) -> None:
        check_bounds(self, "rollout")
        check("rollout", "workflow", not self.workflow or bool(IMPORT_PATH.match(
            self.workflow)), self.workflow, "empty or an import path like 'my_pkg.flows:Flow'")
        check("rollout", "seed", self.seed is None or self.seed >= 0, self.seed,
              "None or >= 0")
        _address_list("rollout", "server_addrs", self.server_addrs)
