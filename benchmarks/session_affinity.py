"""Prefill saved by routing a conversation's turns to one server (session affinity) against
routing each call on its own, on a multi-turn workload over two SGLang servers.

    python benchmarks/session_affinity.py [--sessions 16] [--turns 4] [--rounds 2]

Each session is one `ArealOpenAI` client (as a gateway session is) holding a conversation of
`--turns` turns; every turn adds a user message of random numbers (no two sessions share a
prefix beyond the chat template's). "per session": the client's calls share one request id,
by which the fleet client routes (what the gateway and `ArealOpenAI` do). "per call
(baseline)": a new request id per call, so each call goes to the server with the fewest
requests in flight. From SGLang's replies (`meta_info.cached_tokens`): prompt tokens sent,
taken from the prefix cache, and computed (prefill); the modes alternate, each round with new
conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
import uuid
from contextlib import ExitStack
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from areal_like.api.config import RolloutConfig, ServerConfig  # noqa: E402
from areal_like.api.io_struct import GenerationHyperparameters  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from workflows.openai_client import ArealOpenAI  # noqa: E402


class PerCallRouting(ArealOpenAI):
    """The baseline: each call routed on its own (a new request id per call)."""

    async def _create(self, *args: Any, **kwargs: Any) -> Any:
        self.rid = f"chat-{uuid.uuid4().hex}"
        return await super()._create(*args, **kwargs)


async def conversation(client: ArealOpenAI, turns: int, rng: random.Random) -> None:
    messages: list[Any] = []
    for _ in range(turns):
        numbers = " ".join(str(rng.randrange(10_000)) for _ in range(12))
        messages.append({"role": "user", "content": f"Add these: {numbers}"})
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=16, temperature=1.0)
        messages.append(reply.choices[0].message)


async def run_mode(engine: RemoteInferenceEngine, tokenizer: Any, kind: type[ArealOpenAI],
                   sessions: int, turns: int, seed: int) -> dict[str, float]:
    g = GenerationHyperparameters(max_new_tokens=16)
    clients = [kind(engine, tokenizer, g) for _ in range(sessions)]
    start = time.perf_counter()
    await asyncio.gather(*(conversation(c, turns, random.Random(seed * 1000 + i))
                           for i, c in enumerate(clients)))
    wall = time.perf_counter() - start
    replies = [r.response for c in clients for r in c.completions]
    sent = sum(r.metadata["prompt_tokens"] for r in replies)
    cached = sum(r.metadata["cached_tokens"] for r in replies)
    return {"sent": sent, "cached": cached, "computed": sent - cached, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with ExitStack() as stack:
        from transformers import AutoTokenizer

        from areal_like.models.tiny import build_tiny_model

        model_dir = build_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()),
                                     size="1m", seed=1)
        fleet = stack.enter_context(InferenceFleet(model_dir, ServerConfig(n_servers=2)))
        engine = RemoteInferenceEngine(RolloutConfig(server_addrs=list(fleet.addresses)))
        engine.initialize()
        stack.callback(engine.destroy)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        modes = {"per call (baseline)": PerCallRouting, "per session": ArealOpenAI}
        totals = {name: {"sent": 0.0, "cached": 0.0, "computed": 0.0, "wall": 0.0}
                  for name in modes}
        for rnd in range(args.rounds):
            for i, (name, kind) in enumerate(modes.items()):
                result = engine.run_coroutine(run_mode(
                    engine, tokenizer, kind, args.sessions, args.turns, seed=rnd * 10 + i),
                    timeout=1800)
                for key, value in result.items():
                    totals[name][key] += value
        base = totals["per call (baseline)"]
        print(f"{args.sessions} sessions x {args.turns} turns, {args.rounds} rounds, "
              f"2 SGLang servers (tiny 1m model)")
        print("| routing | prompt tokens sent | from the prefix cache | computed (prefill) "
              "| computed vs baseline | wall s |")
        print("|---|---|---|---|---|---|")
        for name, t in totals.items():
            print(f"| {name} | {t['sent']:.0f} | {t['cached']:.0f} ({t['cached'] / t['sent']:.0%})"
                  f" | {t['computed']:.0f} | {t['computed'] / base['computed']:.2f}x "
                  f"| {t['wall']:.1f} |")


if __name__ == "__main__":
    main()
