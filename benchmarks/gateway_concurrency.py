"""Latency of small agent calls through the gateway while large requests arrive (issue: one
caller's request must not starve the others).

    python benchmarks/gateway_concurrency.py [--small-sessions 8] [--calls 12] [--large 2]

One SGLang server (tiny 1m model), one gateway. `--small-sessions` sessions each make `--calls`
chat completions in turn (a short question, 8 new tokens), first alone (the baseline), then
while `--large` other sessions post, again and again, either bodies just under the gateway's
limit (a message far past the context in characters: refused before it is rendered) or
messages just under that character bound (rendered and tokenized, then refused by the server:
past the context in tokens). Prints the small calls' median and 95th-percentile latency in each
phase and against the baseline, the large calls' count and latency, and the growth of the
process's peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp  # noqa: E402

from areal_like.api.config import RolloutConfig, ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from workflows.gateway import AgentGateway  # noqa: E402


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def small_calls(http: aiohttp.ClientSession, url: str, calls: int) -> list[float]:
    latencies = []
    for i in range(calls):
        body = {"model": "policy", "max_tokens": 8,
                "messages": [{"role": "user", "content": f"What is {i} plus {i + 3}?"}]}
        start = time.perf_counter()
        async with http.post(f"{url}/chat/completions", json=body) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"a small call got HTTP {resp.status}")
        latencies.append(time.perf_counter() - start)
    return latencies


async def large_calls(http: aiohttp.ClientSession, url: str, size: int,
                      stop: asyncio.Event) -> list[float]:
    latencies = []
    text = ("forty two " * (size // 10 + 1))[: size - 200]  # the body stays under the limit
    while not stop.is_set():
        body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user",
                                                                  "content": text}]}
        start = time.perf_counter()
        async with http.post(f"{url}/chat/completions", json=body) as resp:
            await resp.read()
            if resp.status not in (400, 413):
                raise RuntimeError(f"a large call got HTTP {resp.status}, not a refusal")
        latencies.append(time.perf_counter() - start)
    return latencies


async def phase(urls: list[str], large_urls: list[str], calls: int,
                large_chars: int) -> tuple[list[float], list[float]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        stop = asyncio.Event()
        large = [asyncio.create_task(large_calls(http, u, large_chars, stop))
                 for u in large_urls]
        if large:  # let the large ones be under way first
            await asyncio.sleep(0.5)
        small = await asyncio.gather(*(small_calls(http, u, calls) for u in urls))
        stop.set()
        large_done = await asyncio.gather(*large)
    return [x for s in small for x in s], [x for s in large_done for x in s]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-sessions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--large", type=int, default=2)
    args = parser.parse_args()
    with ExitStack() as stack:
        from transformers import AutoTokenizer

        from areal_like.models.tiny import build_tiny_model

        model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                     size="1m", seed=1)
        fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(n_servers=1)))
        engine = RemoteInferenceEngine(RolloutConfig(server_addrs=list(fleet.addresses)))
        engine.initialize()
        stack.callback(engine.destroy)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gateway = AgentGateway(engine, tokenizer, GenerationHyperparameters(max_new_tokens=8))

        async def start() -> list[Any]:
            await gateway.start()
            return [gateway.open_session()
                    for _ in range(args.small_sessions + args.large)]

        sessions = engine.run_coroutine(start(), timeout=60)
        stack.callback(lambda: engine.run_coroutine(gateway.stop(), timeout=60))
        urls = [gateway.session_url(s) for s in sessions]
        small_urls, large_urls = urls[:args.small_sessions], urls[args.small_sessions:]
        body_bytes = gateway.max_body_bytes
        kinds = {"bodies at the limit": body_bytes,
                 "prompts at the character bound": gateway.max_prompt_chars or body_bytes}
        asyncio.run(phase(small_urls, [], 2, 0))  # warm: first calls compile, cache
        before_mb = peak_rss_mb()
        alone, _ = asyncio.run(phase(small_urls, [], args.calls, 0))
        beside = {kind: asyncio.run(phase(small_urls, large_urls, args.calls, chars))
                  for kind, chars in kinds.items()}
        growth_mb = peak_rss_mb() - before_mb
    print(f"{args.small_sessions} sessions x {args.calls} small calls (8 new tokens), one "
          f"SGLang server (tiny 1m model); beside them {args.large} sessions posting large "
          f"calls: bodies of {body_bytes / 2**20:.1f} MiB (the gateway's limit), or "
          f"{kinds['prompts at the character bound']} characters (the context times the "
          f"longest token)")
    print("| small calls | median s | p95 s | median vs alone | large calls | their median s |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(alone)
    print(f"| alone (baseline) | {base:.3f} | {quantile(alone, 0.95):.3f} | 1.00x | - | - |")
    for kind, (small, large) in beside.items():
        print(f"| beside {kind} | {statistics.median(small):.3f} | "
              f"{quantile(small, 0.95):.3f} | {statistics.median(small) / base:.2f}x | "
              f"{len(large)} | {statistics.median(large):.3f} |")
    print(f"the process's peak memory grew {growth_mb:.0f} MB while the large calls arrived")


if __name__ == "__main__":
    main()
