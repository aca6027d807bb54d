"""What deterministic inference costs: SGLang servers with and without it, same requests.

Two servers on the same tiny model run side by side (one thread each): one started with
`ServerConfig.deterministic=True` (seeded sampling + batch-invariant kernels, the
default), the baseline with `False`. They take turns (the idle one sleeps), each time getting
the same requests — default 64 prompts x 64 new tokens (`min_new_tokens = max_new_tokens`),
32 concurrent, temperature 1, a fixed `sampling_seed` per request — from a bare aiohttp
client, after a prefix-cache flush. Median tokens/s over `--rounds`, per model size.

    python benchmarks/deterministic_inference.py [--sizes 1m,10m] [--requests 64]
                                                 [--new-tokens 64] [--concurrency 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp  # noqa: E402
from rollout_throughput import bounded_gather, flush_cache, make_prompts  # noqa: E402

from areal_like.api.config import ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from engines.sglang.protocol import generate_payload  # noqa: E402


async def seeded_client(addr: str, prompts: list[list[int]], g: GenerationHyperparameters,
                        concurrency: int) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> int:
            payload = generate_payload(prompts[i], g, f"det-{time.monotonic_ns()}-{i}",
                                       g.max_new_tokens, g.min_new_tokens, seed=1000 + i)
            async with session.post(f"http://{addr}/generate", json=payload) as resp:
                resp.raise_for_status()
                return len((await resp.json())["output_ids"])

        return await bounded_gather(len(prompts), concurrency, one)


def measure(size: str, args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoConfig

    from areal_like.models.tiny import build_tiny_model

    with ExitStack() as stack:
        model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                     size=size, seed=1)
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        servers = {
            name: stack.enter_context(InferenceFleet(
                model_dir, ServerConfig(n_servers=1, deterministic=flag))).addresses[0]
            for name, flag in (("off (baseline)", False), ("on", True))
        }
        g = GenerationHyperparameters(max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, temperature=1.0)
        prompts = make_prompts(args.requests, vocab, seed=0)
        expected = args.requests * args.new_tokens

        def run(addr: str) -> float:
            flush_cache(addr)
            start = time.perf_counter()
            tokens = asyncio.run(seeded_client(addr, prompts, g, args.concurrency))
            if tokens != expected:
                raise SystemExit(f"{addr} generated {tokens} tokens, expected {expected}")
            return tokens / (time.perf_counter() - start)

        for addr in servers.values():  # warm-up
            run(addr)
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for rnd in range(args.rounds):
            names = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for name in names:
                rates[name].append(run(servers[name]))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1m,10m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    results = {size: measure(size, args) for size in args.sizes.split(",")}
    print(f"\nDeterministic inference: {args.requests} requests x {args.new_tokens} new tokens, "
          f"{args.concurrency} concurrent, median of {args.rounds} rounds\nmachine: "
          f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}\n")
    print(f"{'model':<10}{'deterministic':<16}{'tokens/s':>10}{'ratio':>8}")
    for size, rates in results.items():
        base = rates["off (baseline)"]
        for name, rate in rates.items():
            print(f"{'tiny-' + size:<10}{name:<16}{rate:>10.0f}{rate / base:>8.3f}")


if __name__ == "__main__":
    main()
