"""Rollout throughput: our fleet client vs a bare aiohttp client on the same server (SGLang or
vLLM, `--backend`).

The same requests (default 64 prompts x 64 new tokens, 32 concurrent; `min_new_tokens` =
`max_new_tokens` so every run generates exactly the same number of tokens) are sent
(a) by a bare aiohttp client posting the backend's own generate request — the baseline —
(b) through `RemoteInferenceEngine.agenerate` awaited on the engine's rollout loop (how
workflows call it), and (c) through `agenerate` awaited on a foreign loop (forwarded to the
rollout loop). The server's prefix cache is flushed before every run; clients alternate over
`--rounds` rounds and the median tokens/s of each is reported with its ratio to the baseline
(goal >= 97 %).

    python benchmarks/rollout_throughput.py [--size 1m] [--requests 64] [--new-tokens 64]
                                            [--concurrency 32] [--rounds 3] [--addr HOST:PORT]
                                            [--backend sglang|vllm] [--server-arg=ARG ...]
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
from typing import Awaitable, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp  # noqa: E402

from areal_like.api.config import RolloutConfig, ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest  # noqa: E402
from areal_like.api.rollout_config import StalenessConfig  # noqa: E402
from engines.fleet.backends import server_api  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402

PROMPT_LEN = 16


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def bounded_gather(n: int, concurrency: int, one: Callable[[int], Awaitable[int]]) -> int:
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with sem:
            return await one(i)

    return sum(await asyncio.gather(*(run(i) for i in range(n))))


async def bare_client(addr: str, prompts: list[list[int]], g: GenerationHyperparameters,
                      concurrency: int, backend: str) -> int:
    """The same request as the engine's (the backend's payload, seeded), its reply unchecked."""
    api = server_api(backend)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> int:
            payload = api.generate_payload(prompts[i], g, f"bare-{time.monotonic_ns()}-{i}",
                                           g.max_new_tokens, g.min_new_tokens, seed=i)
            async with session.post(f"http://{addr}{api.generate_path}", json=payload) as resp:
                resp.raise_for_status()
                data = await resp.json()
                return len(data["choices"][0]["token_ids"] if backend == "vllm"
                           else data["output_ids"])

        return await bounded_gather(len(prompts), concurrency, one)


async def engine_client(engine: RemoteInferenceEngine, prompts: list[list[int]],
                        g: GenerationHyperparameters, concurrency: int) -> int:
    async def one(i: int) -> int:
        resp = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g, seed=i))
        return len(resp.output_tokens)

    return await bounded_gather(len(prompts), concurrency, one)


def flush_cache(addr: str, backend: str) -> None:
    path = "/reset_prefix_cache" if backend == "vllm" else "/flush_cache"

    async def flush() -> None:
        async with aiohttp.ClientSession() as s, s.post(f"http://{addr}{path}") as r:
            r.raise_for_status()

    asyncio.run(flush())


def timed(run: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1m", help="tiny model size (ignored with --addr)")
    parser.add_argument("--addr", default=None, help="use a running server instead")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra argument of the started server (repeatable)")
    args = parser.parse_args()

    with ExitStack() as stack:
        if args.addr:
            addr, vocab = args.addr, 256
        else:
            from areal_like.models.tiny import build_tiny_model

            model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                         size=args.size, seed=1)
            fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(
                backend=args.backend, n_servers=1, extra_args=args.server_arg)))
            addr = fleet.addresses[0]
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        engine = RemoteInferenceEngine(RolloutConfig(
            server_addrs=[addr], backend=args.backend,
            staleness=StalenessConfig(max_concurrent_rollouts=args.concurrency)))
        engine.initialize()
        stack.callback(engine.destroy)
        g = GenerationHyperparameters(max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, temperature=1.0)
        prompts = make_prompts(args.requests, vocab, seed=0)
        timeout = 600.0
        clients: dict[str, Callable[[], int]] = {
            "bare aiohttp (baseline)": lambda: asyncio.run(
                bare_client(addr, prompts, g, args.concurrency, args.backend)),
            "our engine (rollout loop)": lambda: engine.run_coroutine(
                engine_client(engine, prompts, g, args.concurrency), timeout),
            "our engine (foreign loop)": lambda: asyncio.run(
                engine_client(engine, prompts, g, args.concurrency)),
        }
        for run in clients.values():  # warm-up: connections, server code paths
            run()
        rates: dict[str, list[float]] = {name: [] for name in clients}
        totals: dict[str, int] = {}
        for rnd in range(args.rounds):
            names = list(clients) if rnd % 2 == 0 else list(reversed(clients))
            for name in names:
                flush_cache(addr, args.backend)
                tokens, seconds = timed(clients[name])
                totals[name] = tokens
                rates[name].append(tokens / seconds)

    expected = args.requests * args.new_tokens
    print(f"\nRollout throughput: {args.requests} requests x {args.new_tokens} new tokens, "
          f"{args.concurrency} concurrent, model tiny-{args.size}, {args.backend}, median of "
          f"{args.rounds} "
          f"rounds\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}\n")
    base = statistics.median(rates["bare aiohttp (baseline)"])
    print(f"{'client':<36}{'tokens':>8}{'tokens/s':>11}{'ratio':>8}")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<36}{totals[name]:>8}{med:>11.0f}{med / base:>8.3f}")
        if totals[name] != expected:
            raise SystemExit(f"{name} generated {totals[name]} tokens, expected {expected}")


if __name__ == "__main__":
    main()
