"""Rollout throughput of a vision-language model: what images cost on one SGLang server.

One server with the tiny Qwen2-VL (`areal_like.models.tiny_vl`); our fleet client sends the
same number of requests (default 64, 32 concurrent, exactly 16 new tokens each) three ways:
(a) text only: the question without an image — the baseline —, (b) one 56 x 56 picture
(4 image tokens) and (c) one 112 x 112 picture (16 image tokens), every picture different, as
in RL. Images are prepared (`VisionProcessor.prompt`) before the clock starts; the server's
prefix cache is flushed before every run; kinds alternate over `--rounds` rounds; the table
gives the median requests/s and generated tokens/s, and each kind's ratio to text only.

    python -m benchmarks.vision_rollout [--requests 64] [--new-tokens 16] [--concurrency 32]
                                         [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from areal_like.api.config import RolloutConfig, ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest  # noqa: E402
from areal_like.api.rollout_config import StalenessConfig  # noqa: E402
from areal_like.models.tiny_vl import build_tiny_vl_model  # noqa: E402
from areal_like.models.vision import VisionProcessor, VisionPrompt  # noqa: E402
from benchmarks.rollout_throughput import bounded_gather, flush_cache  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402

QUESTION = "What colour is the circle?"


def picture(size: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def prompts(processor: VisionProcessor, n: int, size: int) -> list[VisionPrompt]:
    if size == 0:
        text = [{"role": "user", "content": QUESTION}]
        return [processor.prompt(text, []) for _ in range(n)]
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    return [processor.prompt([{"role": "user", "content": parts}], [picture(size, i)])
            for i in range(n)]


async def send(engine: RemoteInferenceEngine, batch: list[VisionPrompt],
               g: GenerationHyperparameters, concurrency: int) -> int:
    async def one(i: int) -> int:
        p = batch[i]
        reply = await engine.agenerate(ModelRequest(input_ids=p.input_ids,
                                                    image_data=p.image_data, gconfig=g, seed=i))
        return len(reply.output_tokens)

    return await bounded_gather(len(batch), concurrency, one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with ExitStack() as stack:
        model_dir = build_tiny_vl_model(stack.enter_context(tempfile.TemporaryDirectory()))
        fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(n_servers=1)))
        addr = fleet.addresses[0]
        engine = RemoteInferenceEngine(RolloutConfig(
            server_addrs=[addr],
            staleness=StalenessConfig(max_concurrent_rollouts=args.concurrency)))
        engine.initialize()
        stack.callback(engine.destroy)
        processor = VisionProcessor(model_dir)
        g = GenerationHyperparameters(max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, temperature=1.0)
        kinds = {"text only (baseline)": 0, "one 56 x 56 picture (4 tokens)": 56,
                 "one 112 x 112 picture (16 tokens)": 112}
        batches = {name: prompts(processor, args.requests, size) for name, size in kinds.items()}
        rates: dict[str, list[float]] = {name: [] for name in kinds}
        for batch in batches.values():  # warm-up
            engine.run_coroutine(send(engine, batch[:4], g, args.concurrency), 600)
        for rnd in range(args.rounds):
            for name in (list(kinds) if rnd % 2 == 0 else list(reversed(kinds))):
                flush_cache(addr, "sglang")
                start = time.perf_counter()
                tokens = engine.run_coroutine(
                    send(engine, batches[name], g, args.concurrency), 600)
                assert tokens == args.requests * args.new_tokens
                rates[name].append(args.requests / (time.perf_counter() - start))
    print(f"\nVision-language rollout: tiny Qwen2-VL, one SGLang server, {args.requests} "
          f"requests x {args.new_tokens} new tokens, {args.concurrency} concurrent, median of "
          f"{args.rounds} rounds\nmachine: {platform.machine()}, {os.cpu_count()} cores\n")
    base = statistics.median(rates["text only (baseline)"])
    print("| prompt | requests/s | tokens/s | vs text only |\n|---|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.1f} | {rate * args.new_tokens:.0f} | {rate / base:.3f} |")


if __name__ == "__main__":
    main()
