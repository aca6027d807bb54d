"""The engine contracts: an inference engine (rollout side) and a train engine."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from areal_like.api.io_struct import (
        AdapterWeights,
        FinetuneSpec,
        FleetView,
        ModelRequest,
        ModelResponse,
        ParamSpec,
        SaveLoadMeta,
        TokenScores,
        UpdateReport,
        WeightUpdateMeta,
    )

# loss_fn(logits, micro_batch) -> scalar loss. `logits` is [T, V] for the packed 1-D tokens of
# the micro-batch; `micro_batch` holds the same packed 1-D layout (plus `cu_seqlens`).
LossFn = Callable[["torch.Tensor", "TensorDict"], "torch.Tensor"]
# loss_weight_fn(micro_batch) -> the micro-batch's weight in the global mean (e.g. #loss tokens).
LossWeightFn = Callable[["TensorDict"], "torch.Tensor | float"]


class FleetClient(abc.ABC):
    """What every client of an inference fleet offers the trainer: lifecycle, pausing, and the
    fleet's weights with their version."""

    @abc.abstractmethod
    def initialize(self) -> None:
        """Connect to the servers and start background machinery."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release every resource; safe to call twice."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop admitting new rollouts (in-flight requests are kept)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Admit rollouts again."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load new weights on every server and label them `meta.version`."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...

    def trainer_version(self) -> int:
        """The version the trainer holds, which consumption checks staleness against: the
        fleet's own, or the version of a driven update already begun (the trainer has it;
        the servers load it while it trains, `rollout.weights.overlap_load`)."""
        return self.get_version()

    # ---- a weight update that trainer rank 0 drives over HTTP itself --------------------
    # (engines.fleet.updater.FleetUpdater): begin -> pause, load, continue each server ->
    # end. In between, the client readmits no server and holds what the pauses abort.
    def begin_weight_update(self, version: int, pause_mode: str) -> FleetView:
        """Hold the fleet for an update to `version` driven by someone else: work pinned to
        the current version finishes first, no server is readmitted until
        `end_weight_update`, and requests aborted by pauses in `pause_mode` are continued.
        Returns the servers to update. Without an `end` within the update's timeouts the
        hold is released and the servers leave service."""
        raise NotImplementedError(f"{type(self).__name__} has no driven weight updates")

    def end_weight_update(self, report: UpdateReport) -> None:
        """Apply what the update did (`report`): failed servers leave service, the version
        moves if `report.advanced`; then release the hold."""
        raise NotImplementedError(f"{type(self).__name__} has no driven weight updates")


class InferenceEngine(FleetClient):
    """Generates tokens for workflows: `agenerate` is the primitive a workflow calls.

    Running workflows into batches (submit / wait / prepare_batch) is the job of a
    `areal_like.api.rollout_api.RolloutAPI` built on an engine, not of the engine itself.
    """

    @abc.abstractmethod
    def initialize(self, loop_thread: Optional[Any] = None, check_health: bool = True) -> None:
        """Connect to the servers. With `loop_thread` (an `areal_like.utils.loop_thread.
        EventLoopThread`) the engine's I/O runs on that loop (the rollout controller's), else
        on a loop of its own; `check_health` first waits until the servers answer."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion (or `gconfig.n_samples` of them, see implementations)."""

    async def agenerate_n(self, req: ModelRequest) -> list[ModelResponse]:
        """`req.gconfig.n_samples` completions of one prompt: here one `agenerate` each,
        concurrently (a fleet client sends them as one request where its servers take it)."""
        one = req.gconfig.new(n_samples=1)
        return list(await asyncio.gather(*(self.agenerate(req.copy(gconfig=one))
                                           for _ in range(req.gconfig.n_samples))))

    async def ascore(self, input_ids: list[int], start: int, rid: str = "score") -> list[float]:
        """log p(input_ids[t] | input_ids[:t]) for t = start .. len - 1 under the served
        weights, nothing sampled (e.g. a teacher scoring the tokens a student sampled)."""
        return (await self.ascore_batch([input_ids], [start], rid))[0]

    async def ascore_batch(self, sequences: list[list[int]], starts: list[int],
                           rid: str = "score", lora_adapter: str = "") -> list[list[float]]:
        """`ascore` of each sequence, in one request where the engine can (under the LoRA
        adapter `lora_adapter` where the servers hold several, see ModelRequest)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score given tokens")

    async def ascore_top_batch(self, sequences: list[list[int]], starts: list[int], top_k: int,
                               rid: str = "score", lora_adapter: str = "") -> list[TokenScores]:
        """`ascore_batch`, and at every scored position the `top_k` most likely next tokens
        (a teacher's next-token distribution, e.g. for an exact KL in the loss)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score given tokens")

    def watch_fleet(self, on_failure: Callable[[BaseException], None]) -> None:
        """Call `on_failure(error)` once the engine has lost its whole fleet (no server left
        in service): the rollout controller then fails its waits with that error. An engine
        that cannot lose its fleet never calls it."""

    def fleet_stats(self) -> dict[str, float]:
        """Counters of the fleet's servers (taken out of service, readmitted, added ...)."""
        return {}


class TrainEngine(abc.ABC):
    """A trainable model behind `forward` / `train_batch`; it never knows the algorithm.

    Batches are TensorDicts of padded [B, L] sequences (`input_ids`, `attention_mask`, and any
    per-token or per-sequence keys the loss needs). The engine packs them into 1-D micro-batches
    under a token budget; `loss_fn` and `post_hook` receive packed 1-D data.
    """

    @abc.abstractmethod
    def initialize(self, addr: Optional[str] = None,
                   ft_spec: Optional[FinetuneSpec] = None) -> None:
        """Load the model, shard it, build optimizer and scheduler (its schedule as long as
        `ft_spec.total_train_steps` when given). `addr` is AReaL-lite's argument: the process
        group comes from the launcher's environment here, so it must be None."""

    def destroy(self) -> None:
        """Release resources (process groups stay owned by the caller)."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> TrainEngine: ...

    def eval(self) -> TrainEngine:
        return self.train(False)

    @abc.abstractmethod
    def forward(
        self,
        batch: TensorDict,
        post_hook: Optional[Callable[[torch.Tensor, TensorDict], torch.Tensor]] = None,
        aggregate_fn: Optional[Callable[[list[torch.Tensor]], Any]] = None,
    ) -> Any:
        """Run the model without gradients. `post_hook(logits, micro_batch)` maps each micro-
        batch's logits to per-token outputs (default: log-probs of the next tokens);
        `aggregate_fn` combines them (default: back to the batch's padded [B, L] layout)."""

    @abc.abstractmethod
    def train_batch(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step over `batch`; the loss is the `loss_weight_fn`-weighted mean of
        `loss_fn` over all micro-batches and ranks. Returns stats (loss, grad_norm, lr, ...)."""

    @abc.abstractmethod
    def eval_batch(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """The same weighted loss as `train_batch`, without a step."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None:
        """With `meta.async_save`, may return once the state is copied, before it is written:
        `wait_for_saves` returns when it is."""

    def wait_for_saves(self) -> None:
        """Collective: every rank's pending asynchronous `save` is written (no-op for an
        engine that saves synchronously)."""

    def saves_written(self) -> bool:
        """Collective, without waiting: whether every rank's asynchronous saves are written."""
        return True

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        """Export the current weights for the inference fleet; returns timing stats."""

    def weight_specs(self) -> list[ParamSpec]:
        """Name, dtype and full shape of every weight the fleet serves, in a fixed order
        (for the distributed transport; no data moves)."""
        raise NotImplementedError(f"{type(self).__name__} has no distributed weight export")

    def iter_weight_buckets(self, buckets: Sequence[Sequence[ParamSpec]]
                            ) -> Iterator[Optional[list[torch.Tensor]]]:
        """Collective (every rank iterates): the full tensors of each bucket in turn, on
        rank 0 (None elsewhere); no rank holds more than one gathered bucket at a time."""
        raise NotImplementedError(f"{type(self).__name__} has no distributed weight export")

    @property
    def lora_enabled(self) -> bool:
        """Whether this engine trains LoRA adapters on a frozen base (then only the adapter
        travels to the fleet: `adapter_weights`)."""
        return False

    def adapter_weights(self) -> Optional[AdapterWeights]:
        """Collective: the current adapter at rank 0, None on the other ranks."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapter")

    @abc.abstractmethod
    def step_lr_scheduler(self) -> None: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...
