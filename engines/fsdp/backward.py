"""The backward passes of a batch's micro-batches, shared by `FSDPEngine.train_batch` (one
weighted-mean step) and `accumulate_gradients` (gradients summed across calls, stepped later
by `apply_gradients`, as a training API such as Tinker's forward_backward / optim_step asks)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from areal_like.api.config import TrainEngineConfig
from areal_like.api.engine_api import LossFn
from engines.fsdp import moe
from engines.fsdp.sharding import clip_gradients

logger = logging.getLogger(__name__)

# (detached logits [T, V], packed micro-batch) -> per-token outputs [T, ...]
OutputsHook = Callable[[torch.Tensor, TensorDict], torch.Tensor]


@dataclass
class BackwardResult:
    """What the backward passes of one rank's micro-batches leave besides gradients."""

    weighted_loss: float = 0.0  # sum over micro-batches of loss * weight (this rank)
    routing: Optional[moe.RoutingTally] = None  # a mixture of experts' statistics
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> outputs_hook's


def scalar_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {got}")
    return loss.reshape(())


def backward_micro_batches(packed_forward: Any, config: TrainEngineConfig, fsdp_size: int,
                           routers: Optional[moe.RouterControl],
                           mbs: list[Optional[TensorDict]], groups: list[list[int]],
                           weights: list[float], total: float, loss_fn: LossFn,
                           outputs_hook: Optional[OutputsHook] = None) -> BackwardResult:
    """Add to the held gradients d/dθ of sum_m weights[m] * loss_fn(mb_m) / total over all
    ranks' micro-batches (FSDP averages over its ranks, hence the factor `fsdp_size`)."""
    result = BackwardResult(routing=moe.RoutingTally() if routers is not None else None)
    for mb, rows, w in zip(mbs, groups, weights, strict=True):
        if mb is None or w == 0:
            # Nothing to learn here (a 0/0 loss would poison the gradients), but FSDP needs
            # the same forward/backward collectives on every rank.
            dummy = mb if mb is not None else packed_forward.dummy()
            logits = packed_forward.logits(dummy)
            (logits.sum() * 0.0).backward()
            if mb is not None and outputs_hook is not None:
                keep_per_row(result.outputs, outputs_hook(logits.detach(), mb), mb, rows,
                             "outputs_hook")
            continue
        logits = packed_forward.logits(mb)
        loss = scalar_loss(loss_fn(logits, mb))
        if outputs_hook is not None:
            keep_per_row(result.outputs, outputs_hook(logits.detach(), mb), mb, rows,
                         "outputs_hook")
        result.weighted_loss += float(loss.detach()) * w
        if routers is not None and result.routing is not None:  # a mixture of experts
            aux = routers.aux_loss()  # the routers' load-balancing loss
            result.routing.add(aux, w, routers.agreement())
            if config.moe.aux_loss_coef > 0:
                loss = loss + config.moe.aux_loss_coef * aux
        # (The ranks of a sequence-parallel group compute the same loss, each over the
        # gradient of its own tokens: their sum is the micro-batch's gradient.)
        (loss * (w * fsdp_size / total)).backward()
    return result


def keep_per_row(per_row: dict[int, torch.Tensor], out: Any, mb: TensorDict, rows: list[int],
                 what: str, device: torch.device = torch.device("cpu")) -> None:
    """A micro-batch's per-token outputs `out` [T, ...] cut into its rows' pieces (on
    `device`); `what` names the function that made them in the error for any other shape."""
    n_tokens = mb["input_ids"].shape[0]
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != n_tokens:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what} must return a per-token tensor [T={n_tokens}, ...], "
                         f"got {got}")
    for row, piece in zip(rows, out.split(mb["cu_seqlens"].diff().tolist()), strict=True):
        per_row[row] = piece.to(device)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   max_grad_norm: float) -> tuple[float, bool]:
    """Clip, step (skipped when the gradient norm is not finite), clear the gradients.
    Returns (the norm before clipping, whether the step was taken)."""
    grad_norm = clip_gradients(model, max_grad_norm)
    ok = math.isfinite(grad_norm)
    if ok:
        optimizer.step()
    else:
        logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, ok
