"""One main-job batch (16 prompts x 8 samples, 6 new tokens) asked of one SGLang server three
ways: a request per sample (what RLVRWorkflow sent before, the baseline), a request per group
(what `RemoteInferenceEngine.agenerate_n` sends now: the group's samples batched, each with its
own rid and seed) and the whole batch in one request.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/request_grouping.py [--rounds 8]

The server (tiny 1M model, forked children, as the main job runs it) and this client share
one core, as the main job's server and rollout controller do with `launcher.cpu_allocation=
split`. Bare aiohttp with the payloads our client sends, so what is measured is the server's
cost per request plus the least a client can spend. Median wall seconds per batch over the
rounds after the first two, ratio to the baseline, and this process's CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp  # noqa: E402

from areal_like.api.config import ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters  # noqa: E402
from areal_like.models.tiny import build_tiny_model  # noqa: E402
from engines.fleet.backends import server_api  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402

GROUPS, SAMPLES, NEW_TOKENS, PROMPT_LEN = 16, 8, 6, 16
API = server_api("sglang")
GCONFIG = GenerationHyperparameters(max_new_tokens=NEW_TOKENS, temperature=1.0)
Way = Callable[[aiohttp.ClientSession, str, list[list[int]]], Awaitable[int]]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(PROMPT_LEN)] for _ in range(GROUPS)]


def payload(prompt: list[int], rid: str, seed: int | None = None) -> dict[str, Any]:
    return API.generate_payload(prompt, GCONFIG, rid, NEW_TOKENS, 0, seed=seed)


async def post(session: aiohttp.ClientSession, addr: str, body: dict[str, Any]) -> Any:
    async with session.post(f"http://{addr}{API.generate_path}", json=body) as resp:
        resp.raise_for_status()
        return await resp.json()


def generated(replies: list[dict[str, Any]], expected: int) -> int:
    if len(replies) != expected:
        raise RuntimeError(f"{len(replies)} replies, expected {expected}")
    return sum(len(r["output_ids"]) for r in replies)


async def per_sample(session: aiohttp.ClientSession, addr: str, ps: list[list[int]]) -> int:
    tag = time.monotonic_ns()
    replies = await asyncio.gather(*(post(session, addr, payload(p, f"s{tag}-{i}-{j}", j))
                                     for i, p in enumerate(ps) for j in range(SAMPLES)))
    return generated(list(replies), GROUPS * SAMPLES)


async def per_group(session: aiohttp.ClientSession, addr: str, ps: list[list[int]]) -> int:
    tag = time.monotonic_ns()

    async def group(i: int, p: list[int]) -> list[dict[str, Any]]:
        body = API.group_payload([payload(p, f"g{tag}-{i}-{j}", j) for j in range(SAMPLES)])
        return list(await post(session, addr, body))

    groups = await asyncio.gather(*(group(i, p) for i, p in enumerate(ps)))
    return generated([r for g in groups for r in g], GROUPS * SAMPLES)


async def one_request(session: aiohttp.ClientSession, addr: str, ps: list[list[int]]) -> int:
    tag = time.monotonic_ns()
    body = API.group_payload([payload(p, f"b{tag}-{i}-{j}", j)
                              for i, p in enumerate(ps) for j in range(SAMPLES)])
    return generated(list(await post(session, addr, body)), GROUPS * SAMPLES)


async def measure(addr: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    ways: dict[str, Way] = {"request per sample": per_sample, "request per group": per_group,
                            "one request": one_request}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for r in range(rounds):
            for name, way in ways.items():  # interleaved: a slow spell hits every way
                wall, cpu = time.perf_counter(), time.process_time()
                await way(session, addr, prompts(r))
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with ExitStack() as stack:
        model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                     size="1m", seed=1)
        fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(
            backend="sglang", n_servers=1, fork_children=True)))
        times = asyncio.run(measure(fleet.addresses[0], args.rounds))
    skip = min(2, args.rounds - 1)
    base = statistics.median(t for t, _ in times["request per sample"][skip:])
    print(f"{GROUPS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, SGLang, tiny-1m, "
          f"median of {args.rounds - skip} rounds")
    print("| way | s per batch | vs per sample | client CPU s |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        wall = statistics.median(t for t, _ in samples[skip:])
        cpu = statistics.median(c for _, c in samples[skip:])
        print(f"| {name} | {wall:.3f} | {wall / base:.2f}x | {cpu:.3f} |")


if __name__ == "__main__":
    main()
