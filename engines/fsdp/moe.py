"""A mixture of experts' routers in the FSDP2 engine: the load-balancing loss and router
replay (R3).

Every router of the model is wrapped (`RouterControl`) so that, during a micro-batch's
forward, it records its logits and the experts it selected, and, when the micro-batch carries
`routed_experts` and replay is on, selects the experts the inference server chose instead of
its own top-k. The gates are then recomputed from the trainer's own router logits over the
replayed experts (softmax over all experts, gathered, renormalised when the model's
`norm_topk_prob` says so), as R3 does: the gradient still reaches the router.

`routed_experts` is a per-token key [T, n_moe_layers * top_k] of expert ids, layer by layer
as the server records them (int16; -1 where the server recorded none, e.g. the last generated
token, which it never forwarded: those tokens route by the trainer's own top-k).

The load-balancing loss is transformers' (Switch Transformer): over the tokens of all MoE
layers, n_experts * sum_e f_e P_e, f_e the share of routing slots that went to expert e and
P_e its mean router probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from areal_like.api.moe_config import MoEConfig
from areal_like.api.trajectory import NO_EXPERT, ROUTED_EXPERTS
from engines.fsdp.dist import all_reduce_scalar


@dataclass(frozen=True)
class MoEShape:
    """What a trajectory's `routed_experts` must agree with."""

    n_layers: int  # MoE layers (decoder layers with a sparse MLP), in order
    n_experts: int
    top_k: int


def moe_shape(config: Any) -> Optional[MoEShape]:
    """The MoE layout of an HF config (its text config for a VLM); None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not n_experts or not top_k:
        return None
    layers = int(text.num_hidden_layers)
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    n_moe = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return MoEShape(n_layers=n_moe, n_experts=int(n_experts), top_k=int(top_k))


def _is_router(module: torch.nn.Module) -> bool:
    """A top-k softmax router returning (logits, scores, indices), as Qwen-MoE's."""
    return all(hasattr(module, a) for a in ("top_k", "num_experts", "norm_topk_prob", "weight"))


def router_control(model: torch.nn.Module, config: MoEConfig, lora: bool,
                   path: str) -> Optional[RouterControl]:
    """The routers of a mixture of experts under the engine's control; None for a dense model
    (which refuses `actor.moe` settings it cannot honour)."""
    shape = moe_shape(getattr(model, "config", None))
    if shape is None:
        if config.changed:
            raise ValueError(f"actor.moe is set ({config}) but the model at {path!r} is dense: "
                             f"it has no experts to balance or replay; unset actor.moe")
        return None
    if lora:
        raise ValueError(
            f"actor.lora.rank > 0 on the mixture of experts at {path!r}: not supported. "
            f"transformers holds each layer's experts as fused 3-D parameters, which PEFT's "
            f"LoRA layers do not wrap, so adapters could reach attention only, and the "
            f"servers' LoRA serving of MoE layers is untested here; train the full weights "
            f"(actor.lora.rank=0)")
    return RouterControl(model, shape)


class RouterControl:
    """Records and (optionally) replays the routing of every MoE layer of `model`."""

    def __init__(self, model: torch.nn.Module, shape: MoEShape) -> None:
        self.shape = shape
        self.routers = [m for m in model.modules() if _is_router(m)]
        if len(self.routers) != shape.n_layers:
            raise ValueError(
                f"{type(model).__name__}: found {len(self.routers)} top-k softmax routers "
                f"(top_k, num_experts, norm_topk_prob, weight) but the config has "
                f"{shape.n_layers} MoE layers; this router type is not supported")
        self._replay: Optional[torch.Tensor] = None
        self._recorded: Optional[torch.Tensor] = None
        self._agreement: list[torch.Tensor] = []
        self._logits: list[torch.Tensor] = []
        self._selected: list[torch.Tensor] = []
        for layer, router in enumerate(self.routers):
            router.forward = self._routing_forward(layer, router)

    # ------------------------------------------------------------------ one forward
    def begin(self, mb: TensorDict, replay: bool) -> None:
        """Before a packed micro-batch's forward; `replay`: route by its `routed_experts`
        (with or without replay, routing the batch carries is compared with the trainer's
        own: `agreement`)."""
        routed: Optional[torch.Tensor] = None
        if ROUTED_EXPERTS in mb.keys():
            routed = mb[ROUTED_EXPERTS]
            check_routed_experts(routed, self.shape, f"the batch's {ROUTED_EXPERTS!r}")
            routed = routed.reshape(-1, self.shape.n_layers, self.shape.top_k)
        elif replay:
            raise ValueError(
                f"actor.moe.router_replay is on but the batch carries no "
                f"{ROUTED_EXPERTS!r}: the rollout must return them "
                f"(rollout.return_routed_experts=true); keys: {sorted(mb.keys())}")
        self._recorded, self._replay = routed, routed if replay else None
        self._logits, self._selected = [], []
        self._agreement = []  # per layer: (routes the trainer's top-k agrees on, routes)

    def unrouted(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        """`routed_experts` of `n_tokens` tokens with no record (each routes by its top-k)."""
        return torch.full((n_tokens, self.shape.n_layers * self.shape.top_k), NO_EXPERT,
                          dtype=torch.int16, device=device)

    def _routing_forward(self, layer: int, router: torch.nn.Module) -> Any:
        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
            logits = F.linear(hidden, cast(torch.Tensor, router.weight))
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top_value, top_index = torch.topk(probs, self.shape.top_k, dim=-1)
            if self._recorded is not None:
                recorded = self._recorded[:, layer].to(top_index.device).long()
                if recorded.shape[0] != top_index.shape[0]:
                    raise ValueError(f"routed_experts has {recorded.shape[0]} tokens; the "
                                     f"micro-batch has {top_index.shape[0]}")
                self._count_agreement(top_index, recorded)
            if self._replay is not None:
                top_index = torch.where(recorded >= 0, recorded, top_index)
                top_value = probs.gather(-1, top_index)
            if router.norm_topk_prob:
                top_value = top_value / top_value.sum(dim=-1, keepdim=True)
            self._logits.append(logits)
            self._selected.append(top_index)
            return logits, top_value.to(logits.dtype), top_index
        return forward

    def _count_agreement(self, own: torch.Tensor, recorded: torch.Tensor) -> None:
        """Routes (token, layer) where the trainer's own top-k is the server's expert set
        (counted on the device: read once, by `agreement`)."""
        with torch.no_grad():
            has = recorded[:, 0] >= 0
            same = (own.sort(-1).values == recorded.sort(-1).values).all(-1) & has
            self._agreement.append(torch.stack([same.sum(), has.sum()]))

    def agreement(self) -> tuple[float, float]:
        """Of the last forward: (routes where the trainer's own top-k picks the experts the
        server routed to, routes the server recorded)."""
        if not self._agreement:
            return 0.0, 0.0
        agreed, recorded = torch.stack(self._agreement).sum(0).tolist()
        return float(agreed), float(recorded)

    def selected_experts(self) -> torch.Tensor:
        """The experts the last forward routed each token to: [T, n_layers, top_k]."""
        return torch.stack(self._selected, dim=1)

    def aux_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss (see the module doc), differentiable."""
        if len(self._logits) != self.shape.n_layers:
            raise RuntimeError(f"the last forward ran {len(self._logits)} of "
                               f"{self.shape.n_layers} MoE layers")
        probs = torch.softmax(torch.cat(self._logits).float(), dim=-1)
        slots = F.one_hot(torch.cat(self._selected), self.shape.n_experts).float()
        tokens_per_expert = slots.mean(dim=0)  # [top_k, n_experts]
        return (tokens_per_expert * probs.mean(dim=0)[None]).sum() * self.shape.n_experts


class RoutingTally:
    """train_batch's MoE statistics over its micro-batches and ranks: the balancing loss
    (weighted like the loss) and, where the batch carried the server's routing, the share of
    routes the trainer's own top-k agrees with."""

    def __init__(self) -> None:
        self.weighted_aux, self.agreed, self.recorded = 0.0, 0.0, 0.0

    def add(self, aux: torch.Tensor, weight: float, agreement: tuple[float, float]) -> None:
        self.weighted_aux += float(aux.detach()) * weight
        self.agreed += agreement[0]
        self.recorded += agreement[1]

    def stats(self, total_weight: float, device: torch.device) -> dict[str, float]:
        """Collective (every rank): the step's `moe_aux_loss`, `moe_route_agreement`."""
        stats = {"moe_aux_loss": all_reduce_scalar(self.weighted_aux, device) / total_weight}
        recorded = all_reduce_scalar(self.recorded, device)
        if recorded > 0:
            stats["moe_route_agreement"] = all_reduce_scalar(self.agreed, device) / recorded
        return stats


def check_routed_experts(routed: torch.Tensor, shape: MoEShape, where: str) -> None:
    """A clear error when `routed` [..., n_layers * top_k] does not fit the model."""
    slots = shape.n_layers * shape.top_k
    if routed.dim() < 1 or routed.shape[-1] != slots:
        raise ValueError(f"{where} has shape {tuple(routed.shape)}: "
                         f"{routed.shape[-1] if routed.dim() else 0} expert ids per token; the "
                         f"model routes every token through {shape.n_layers} MoE layers with "
                         f"top_k={shape.top_k}, {slots} ids (does the server run another "
                         f"model, or another num_experts_per_tok?)")
    if routed.is_floating_point():
        raise ValueError(f"{where} must hold integer expert ids, got {routed.dtype}")
    if routed.numel() and (int(routed.max()) >= shape.n_experts
                           or int(routed.min()) < NO_EXPERT):
        raise ValueError(f"{where} holds expert ids in [{int(routed.min())}, "
                         f"{int(routed.max())}]; the model has {shape.n_experts} experts "
                         f"(ids 0..{shape.n_experts - 1}, {NO_EXPERT}: none recorded)")
