"""An instant in-process InferenceEngine and small workflows, for unit tests of the executor
only (the executor against real SGLang is covered by the integration tests)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
)
from areal_like.api.config import RolloutConfig
from areal_like.rollout import WorkflowExecutor


class InstantEngine(InferenceEngine):
    """Answers every request at once; each output token carries the current version."""

    def __init__(self, config: RolloutConfig) -> None:
        self.version = 0
        self.updating_to: Optional[int] = None  # a driven update begun, not ended
        self.requests = 0
        self.executor = WorkflowExecutor(config, self, wait_timeout=30.0)

    def initialize(self) -> None:
        self.executor.initialize()

    def destroy(self) -> None:
        self.executor.destroy()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests += 1
        n = req.gconfig.max_new_tokens
        out = [(t + len(req.input_ids)) % 50 + 1 for t in range(n)]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                             output_logprobs=[-0.5] * n, output_versions=[self.version] * n)

    def pause(self) -> None:
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()

    def update_weights(self, meta: Any) -> None:
        self.version = meta.version

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def trainer_version(self) -> int:
        return max(self.version, self.updating_to or 0)


def pad_rows(rows: list[list[Any]], pad: Any, dtype: torch.dtype) -> torch.Tensor:
    length = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (length - len(r)) for r in rows], dtype=dtype)


class GroupWorkflow(RolloutWorkflow):
    """`n` samples per item (sample i has 2 + i + item-dependent new tokens).

    Generation happens as soon as the episode starts (the instant engine stamps the version
    of that moment). Knobs: `max_sleep` then adds a random delay and `gate` (a
    threading.Event) holds the episode until set; `fail_ids` raise ValueError;
    `on_start(data)` is called when an episode starts (on the loop thread).
    """

    def __init__(self, n: int = 2, gate: Optional[threading.Event] = None,
                 fail_ids: tuple[int, ...] = (), max_sleep: float = 0.0,
                 on_start: Optional[Callable[[dict], None]] = None, seed: int = 0) -> None:
        self.n = n
        self.gate = gate
        self.fail_ids = fail_ids
        self.max_sleep = max_sleep
        self.on_start = on_start
        self.rng = random.Random(seed)

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> Optional[TensorDict]:
        if self.on_start is not None:
            self.on_start(data)
        if data["id"] in self.fail_ids:
            raise ValueError(f"boom on item {data['id']}")
        prompt = data["prompt"]
        ids, loss, logp, vers = [], [], [], []
        for i in range(self.n):
            g = GenerationHyperparameters(max_new_tokens=2 + i + data["id"] % 3)
            resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
            ids.append(prompt + resp.output_tokens)
            loss.append([0] * len(prompt) + [1] * resp.output_len)
            logp.append([0.0] * len(prompt) + resp.output_logprobs)
            vers.append([-1] * len(prompt) + resp.output_versions)
        if self.max_sleep:  # finish in a shuffled order
            await asyncio.sleep(self.rng.random() * self.max_sleep)
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.002)
        input_ids = pad_rows(ids, 0, torch.long)
        return TensorDict({
            "input_ids": input_ids,
            "attention_mask": pad_rows([[1] * len(r) for r in ids], 0, torch.bool),
            "loss_mask": pad_rows(loss, 0, torch.bool),
            "logprobs": pad_rows(logp, 0.0, torch.float32),
            "versions": pad_rows(vers, -1, torch.long),
            "rewards": torch.tensor([float(data["id"] % 2)] * self.n),
            "data_id": torch.tensor([data["id"]] * self.n),
        }, batch_size=[self.n])


def items(start: int, stop: int) -> list[dict[str, Any]]:
    return [{"id": i, "prompt": [7, 8, 9][: 1 + i % 3]} for i in range(start, stop)]


def eventually(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until true; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s: {what}")
        time.sleep(0.002)


def group_ids(batch: TensorDict) -> list[int]:
    """The data id of each group in a batch (rows of one group are consecutive)."""
    out: list[int] = []
    for i in batch["data_id"].tolist():
        if not out or out[-1] != i:
            out.append(i)
    return out
