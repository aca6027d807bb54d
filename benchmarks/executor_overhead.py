"""Executor overhead (part 1): what the WorkflowExecutor adds on top of the episodes themselves.

An instant in-process engine (no network, no model) isolates the executor's own cost: the
same episodes are run (a) directly with `asyncio.gather` on a private loop — the baseline —
and (b) through the executor: `submit` x N + `wait(N)`, `rollout_batch`, and the trainer's
`prepare_batch` loop with version bumps (η = 1). Latency: one episode at a time,
`loop.run_until_complete` vs `submit` + `wait(1)` from the trainer thread.

    python benchmarks/executor_overhead.py [--episodes 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from areal_like.api import (  # noqa: E402
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
    validate_trajectory,
)
from areal_like.api.config import RolloutConfig  # noqa: E402
from areal_like.rollout import WorkflowExecutor, concat_padded  # noqa: E402

PROMPT = list(range(1, 17))
NEW_TOKENS = 16


class InstantEngine(InferenceEngine):
    def __init__(self) -> None:
        self.version = 0

    def initialize(self) -> None: ...

    def destroy(self) -> None: ...

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        n = req.gconfig.max_new_tokens
        return ModelResponse(list(req.input_ids), [5] * n, [-0.5] * n, [self.version] * n)

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, meta: Any) -> None: ...

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


class OneShotWorkflow(RolloutWorkflow):
    """One request, one [1, 32] trajectory."""

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> TensorDict:
        req = ModelRequest(input_ids=PROMPT)
        req.gconfig.max_new_tokens = NEW_TOKENS
        resp = await engine.agenerate(req)
        p, n = len(PROMPT), resp.output_len
        return TensorDict({
            "input_ids": torch.tensor([PROMPT + resp.output_tokens]),
            "attention_mask": torch.ones(1, p + n, dtype=torch.bool),
            "loss_mask": torch.tensor([[False] * p + [True] * n]),
            "logprobs": torch.tensor([[0.0] * p + resp.output_logprobs]),
            "versions": torch.tensor([[-1] * p + resp.output_versions]),
            "rewards": torch.tensor([1.0]),
        }, batch_size=[1])


def best_interleaved(repeats: int, modes: list[tuple[str, Callable[[], float]]]
                     ) -> list[tuple[str, float]]:
    """Best time of each mode, the modes taking turns so that load changes on a shared
    machine hit them all alike."""
    best = {name: float("inf") for name, _ in modes}
    for _ in range(repeats):
        for name, fn in modes:
            best[name] = min(best[name], fn())
    return [(name, best[name]) for name, _ in modes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=4000)
    ap.add_argument("--latency-episodes", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="consumer_batch_size for prepare_batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, wf = args.episodes, OneShotWorkflow()
    data = [{"id": i} for i in range(n)]
    engine = InstantEngine()

    def gather_direct(post: bool) -> float:
        async def run() -> list[TensorDict]:
            return await asyncio.gather(*[wf.arun_episode(engine, d) for d in data])

        start = time.perf_counter()
        out = asyncio.run(run())
        if post:  # what the executor adds per episode besides scheduling
            for td in out:
                validate_trajectory(td)
            concat_padded(out)
        return time.perf_counter() - start

    cfg = RolloutConfig(max_concurrent_rollouts=256, max_head_offpolicyness=1,
                        consumer_batch_size=args.batch)
    # a bound that never binds, to time submit/wait alone
    unbounded = RolloutConfig(max_concurrent_rollouts=256, max_head_offpolicyness=10**9,
                              consumer_batch_size=1)
    ex = WorkflowExecutor(unbounded, engine, wait_timeout=600)
    ex.initialize()

    def submit_wait() -> float:
        start = time.perf_counter()
        for d in data:
            ex.submit(d, wf)
        ex.wait(n)
        return time.perf_counter() - start

    def rollout_batch() -> float:
        start = time.perf_counter()
        ex.rollout_batch(data, wf)
        return time.perf_counter() - start

    def prepare_loop() -> float:
        local = WorkflowExecutor(cfg, InstantEngine(), wait_timeout=600)
        local.initialize()
        try:
            steps = n // args.batch
            start = time.perf_counter()
            for step in range(steps):
                local.prepare_batch(data, wf)
                local.engine.set_version(step + 1)
            return (time.perf_counter() - start) * n / (steps * args.batch)
        finally:
            local.destroy()

    def latency_direct() -> list[float]:
        loop = asyncio.new_event_loop()
        try:
            times = []
            for d in data[: args.latency_episodes]:
                t0 = time.perf_counter()
                loop.run_until_complete(wf.arun_episode(engine, d))
                times.append(time.perf_counter() - t0)
            return times
        finally:
            loop.close()

    def latency_executor() -> list[float]:
        times = []
        for d in data[: args.latency_episodes]:
            t0 = time.perf_counter()
            ex.submit(d, wf)
            ex.wait(1)
            times.append(time.perf_counter() - t0)
        return times

    rows = best_interleaved(args.repeats, [
        ("asyncio.gather (baseline)", lambda: gather_direct(False)),
        ("gather + validate + concat", lambda: gather_direct(True)),
        ("executor submit x N + wait(N)", submit_wait),
        ("executor rollout_batch(N)", rollout_batch),
        (f"executor prepare_batch (B={args.batch}, eta=1)", prepare_loop),
    ])
    lat_direct = statistics.median(latency_direct())
    lat_exec = statistics.median(latency_executor())
    ex.destroy()

    base = rows[0][1]
    print(f"# Executor overhead: {n} instant episodes, best of {args.repeats} (interleaved); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"| {'mode':<40} | {'episodes/s':>10} | {'us/episode':>10} | {'x baseline':>10} "
          f"| {'added us/ep':>11} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 13}|")
    for name, secs in rows:
        per = secs / n * 1e6
        print(f"| {name:<40} | {n / secs:>10.0f} | {per:>10.1f} | {secs / base:>10.2f} "
              f"| {per - base / n * 1e6:>11.1f} |")
    print()
    print(f"| {'latency, one episode at a time (median)':<40} | {'us':>10} | {'x direct':>10} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 12}|")
    print(f"| {'loop.run_until_complete (baseline)':<40} | {lat_direct * 1e6:>10.1f} | "
          f"{1.0:>10.2f} |")
    print(f"| {'executor submit + wait(1)':<40} | {lat_exec * 1e6:>10.1f} | "
          f"{lat_exec / lat_direct:>10.2f} |")


if __name__ == "__main__":
    main()
