"""The `actor.moe` section: how the trainer treats a mixture-of-experts model's routers.

Read only when the model is a mixture of experts (a dense model with a non-default value here
is refused at start: engines/fsdp/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from areal_like.api.config_checks import at_least, bounded, check_bounds


@dataclass
class MoEConfig:
    """The routers' load-balancing loss and router replay (R3)."""

    # weight of the routers' load-balancing loss (Switch-Transformer form, as transformers
    # computes it) added to every micro-batch's loss; 0: logged only (moe_aux_loss)
    aux_loss_coef: float = bounded(0.0, bound=at_least(0.0))
    # route every trained token to the experts the inference server chose for it (the
    # trajectory's `routed_experts`), gates recomputed over them from the trainer's logits
    router_replay: bool = False

    def __post_init__(self) -> None:
        check_bounds(self, "MoEConfig")

    @property
    def changed(self) -> bool:
        """Set to anything but the defaults (which only a mixture of experts can use)."""
        return self.aux_loss_coef != 0.0 or self.router_replay


# SGLang's switch for recording each token's experts (its routed-experts capturer)
RECORD_ROUTING_ARG = "--enable-return-routed-experts"


class ServerSettings(Protocol):  # the fields of config.ServerConfig used here
    backend: str
    extra_args: list[str]


class RolloutSettings(Protocol):  # ... and of config.RolloutConfig
    backend: str
    server_addrs: list[str]
    return_routed_experts: bool


def serve_routed_experts(moe: MoEConfig, server: ServerSettings,
                         rollout: RolloutSettings) -> None:
    """Router replay needs every reply's routing, and servers that record it: fill those
    settings (in place; called by `BaseExperimentConfig.__post_init__`) and refuse a fleet
    that cannot."""
    if moe.router_replay:
        rollout.return_routed_experts = True
    if not rollout.return_routed_experts:
        return
    backend = rollout.backend or server.backend
    if backend != "sglang":
        raise ValueError(f"rollout.return_routed_experts (or actor.moe.router_replay) with a "
                         f"{backend} fleet: only SGLang servers return routed experts here "
                         f"(docs/algorithms.md, router replay); use server.backend=sglang")
    if not rollout.server_addrs and RECORD_ROUTING_ARG not in server.extra_args:
        server.extra_args.append(RECORD_ROUTING_ARG)  # the launcher starts the servers
