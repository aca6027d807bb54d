"""Executor overhead: what the WorkflowExecutor adds on top of the episodes themselves.

Part 1 (instant in-process engine: no network, no model) isolates the executor's own cost: the
same episodes are run (a) directly with `asyncio.gather` on a private loop — the baseline —
and (b) through the executor: `submit` x N + `wait(N)`, `rollout_batch`, and the trainer's
`prepare_batch` loop with version bumps (η = 1). Latency: one episode at a time,
`loop.run_until_complete` vs `submit` + `wait(1)` from the trainer thread.

Part 2 (one real SGLang server, tiny model): rollout tokens/s of the bare aiohttp client of
`rollout_throughput.py` — the baseline — against the same requests run as `RLVRWorkflow`
episodes (`n_samples` per prompt, `min_new_tokens = max_new_tokens`, a trivial reward) through
the executor: `rollout_batch`, and `prepare_batch` (η = 0, one batch of all groups, a fresh
executor each run). Same concurrency: `concurrency / n_samples` episodes run at once. The
server's prefix cache is flushed before every run; modes alternate order; median of `--rounds`.

    python benchmarks/executor_overhead.py [--part 1|2|both]
        part 1: [--episodes 4000] [--repeats 5] [--batch 64]
        part 2: [--size 1m] [--requests 64] [--new-tokens 64] [--concurrency 32]
                [--n-samples 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
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
from areal_like.api.rollout_config import StalenessConfig  # noqa: E402
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


def part1(args: argparse.Namespace) -> None:
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

    cfg = RolloutConfig(staleness=StalenessConfig(
        max_concurrent_rollouts=256, max_head_offpolicyness=1, consumer_batch_size=args.batch))
    # a bound that never binds, to time submit/wait alone
    unbounded = RolloutConfig(staleness=StalenessConfig(
        max_concurrent_rollouts=256, max_head_offpolicyness=10**9, consumer_batch_size=1))
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


# ---- part 2: real SGLang server ---------------------------------------------------------------
async def zero_reward_async(prompt: str, completion: str, **data: Any) -> float:
    """Trivial reward, awaited on the rollout loop: the episode cost is the executor's own."""
    return 0.0


def zero_reward(prompt: str, completion: str, **data: Any) -> float:
    """Trivial sync reward: runs in the workflow's reward process pool (the default path)."""
    return 0.0


def addition_items(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        items.append({"id": i, "answer": str(a + b),
                      "messages": [{"role": "user", "content": f"What is {a}+{b}?"}]})
    return items


def part2(args: argparse.Namespace) -> None:
    try:  # run as a script: benchmarks/ is sys.path[0]
        from rollout_throughput import bare_client, flush_cache, timed
    except ModuleNotFoundError:  # python -m benchmarks.executor_overhead
        from benchmarks.rollout_throughput import bare_client, flush_cache, timed

    from areal_like.api import GenerationHyperparameters
    from areal_like.api.config import ServerConfig
    from areal_like.models.tiny import build_tiny_model
    from areal_like.rollout.controller import RolloutController
    from engines.fleet.client import RemoteSGLangEngine
    from engines.fleet.launch import InferenceFleet
    from workflows.rlvr import RLVRWorkflow

    k = args.n_samples
    if args.requests % k or args.concurrency % k:
        raise SystemExit(f"--requests ({args.requests}) and --concurrency ({args.concurrency}) "
                         f"must be multiples of --n-samples ({k})")
    n_groups, timeout = args.requests // k, 600.0
    items = addition_items(n_groups, seed=0)
    gconfig = GenerationHyperparameters(n_samples=k, max_new_tokens=args.new_tokens,
                                        min_new_tokens=args.new_tokens, temperature=1.0)
    with ExitStack() as stack:
        model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                     size=args.size, seed=1)
        wf_async = RLVRWorkflow(zero_reward_async, gconfig, str(model_dir))
        wf_sync = RLVRWorkflow(zero_reward, gconfig, str(model_dir))
        fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(n_servers=1)))
        addr = fleet.addresses[0]
        # at most concurrency / k episodes of k requests each: `concurrency` requests in flight
        config = RolloutConfig(server_addrs=[addr], staleness=StalenessConfig(
            max_concurrent_rollouts=args.concurrency // k, consumer_batch_size=n_groups,
            max_head_offpolicyness=0))

        def new_engine() -> RolloutController:
            engine = RolloutController(config, RemoteSGLangEngine(config))
            engine.initialize()
            return engine

        engine = new_engine()
        stack.callback(engine.destroy)
        # the bare client sends each prompt's tokens k times, with the workflow's own stop ids
        prompts = [wf_async.prompt_ids(item) for item in items for _ in range(k)]
        single = wf_async.gconfig.new(n_samples=1)

        def generated(batch: TensorDict) -> int:
            return int(batch["loss_mask"].sum())

        def prepare_fresh() -> tuple[int, float]:
            local = new_engine()  # η = 0, version 0: admits exactly the n_groups of one batch
            try:
                return timed(lambda: generated(local.prepare_batch(items, wf_async,
                                                                   timeout=timeout)))
            finally:
                local.destroy()

        modes: dict[str, Callable[[], tuple[int, float]]] = {
            "bare aiohttp (baseline)": lambda: timed(lambda: asyncio.run(
                bare_client(addr, prompts, single, args.concurrency))),
            "RLVR rollout_batch": lambda: timed(lambda: generated(
                engine.rollout_batch(items, wf_async, timeout=timeout))),
            "RLVR prepare_batch (eta=0)": prepare_fresh,
            "RLVR rollout_batch, sync reward (pool)": lambda: timed(lambda: generated(
                engine.rollout_batch(items, wf_sync, timeout=timeout))),
        }
        for run in modes.values():  # warm-up: connections, server code paths, reward pool
            run()
        rates: dict[str, list[float]] = {name: [] for name in modes}
        totals: dict[str, int] = {}
        for rnd in range(args.rounds):
            for name in (list(modes) if rnd % 2 == 0 else list(reversed(modes))):
                flush_cache(addr)
                totals[name], seconds = modes[name]()
                rates[name].append(totals[name] / seconds)

    expected = args.requests * args.new_tokens
    print(f"\n# Executor overhead, part 2: {n_groups} prompts x {k} samples = {args.requests} "
          f"requests x {args.new_tokens} new tokens, {args.concurrency} requests in flight, "
          f"model tiny-{args.size}, one SGLang server, median of {args.rounds} rounds "
          f"(alternating order)\n# machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    base = statistics.median(rates["bare aiohttp (baseline)"])
    print(f"| {'client':<40} | {'tokens':>6} | {'tokens/s':>8} | {'min..max tok/s':>14} "
          f"| {'x bare':>6} |")
    print(f"|{'-' * 42}|{'-' * 8}|{'-' * 10}|{'-' * 16}|{'-' * 8}|")
    for name, values in rates.items():
        med = statistics.median(values)
        spread = f"{min(values):.0f}..{max(values):.0f}"
        print(f"| {name:<40} | {totals[name]:>6} | {med:>8.0f} | {spread:>14} "
              f"| {med / base:>6.3f} |")
    for name, tokens in totals.items():
        if tokens != expected:
            raise SystemExit(f"{name} generated {tokens} tokens, expected {expected}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    one = ap.add_argument_group("part 1 (instant engine)")
    one.add_argument("--episodes", type=int, default=4000)
    one.add_argument("--latency-episodes", type=int, default=500)
    one.add_argument("--repeats", type=int, default=5)
    one.add_argument("--batch", type=int, default=64, help="consumer_batch_size for prepare_batch")
    two = ap.add_argument_group("part 2 (one real SGLang server)")
    two.add_argument("--size", default="1m", help="tiny model size")
    two.add_argument("--requests", type=int, default=64)
    two.add_argument("--new-tokens", type=int, default=64)
    two.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    two.add_argument("--n-samples", type=int, default=4, help="samples per prompt (group)")
    two.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part in ("1", "both"):
        part1(args)
    if args.part in ("2", "both"):
        part2(args)


if __name__ == "__main__":
    main()
