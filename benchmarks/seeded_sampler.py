"""The seeded sampler on a CPU SGLang server: SGLang's `torch.compile`d `multinomial_with_seed`
against the CPU shim's eager one (engines/sglang/shim/README.md), in the same run.

    python benchmarks/seeded_sampler.py [--rounds 8] [--concurrency 32]

Per mode one real server (tiny 1m model, deterministic inference, forked children) is started;
measured: the first sampled request after start (where the compile happens), then the median
of sequential requests and of rounds of `--concurrency` concurrent ones (16 new tokens each,
seeded). `AREAL_LIKE_SGLANG_COMPILED_SAMPLER=1` in a server's environment keeps SGLang's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from areal_like.api.config import ServerConfig
from areal_like.models.tiny import build_tiny_model
from engines.fleet.launch import InferenceFleet


def _generate(addr: str, seed: int) -> None:
    params = {"max_new_tokens": 16, "min_new_tokens": 16, "temperature": 1.0,
              "sampling_seed": seed}
    body = json.dumps({"input_ids": list(range(1, 10)) + [10 + seed % 5],
                       "sampling_params": params}).encode()
    request = urllib.request.Request(f"http://{addr}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        json.load(reply)


def measure(model: Path, mode: str, rounds: int, concurrency: int, tmp: Path) -> dict:
    os.environ["AREAL_LIKE_SGLANG_COMPILED_SAMPLER"] = "1" if mode == "compiled" else "0"
    config = ServerConfig(n_servers=1, fork_children=True, context_length=1024)
    with InferenceFleet(model, config, log_dir=tmp / f"logs-{mode}") as fleet:
        addr = fleet.addresses[0]
        start = time.perf_counter()
        _generate(addr, 0)
        first = time.perf_counter() - start
        sequential = []
        for seed in range(20):
            start = time.perf_counter()
            _generate(addr, seed)
            sequential.append(time.perf_counter() - start)
        concurrent_rounds = []
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for _ in range(rounds):
                start = time.perf_counter()
                list(pool.map(lambda s: _generate(addr, s), range(concurrency)))
                concurrent_rounds.append(time.perf_counter() - start)
    return {"mode": mode, "first": first, "sequential": statistics.median(sequential),
            "concurrent": statistics.median(concurrent_rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="seeded_sampler_") as tmp:
        model = build_tiny_model(Path(tmp) / "model", "1m", seed=1)
        rows = [measure(model, mode, args.rounds, args.concurrency, Path(tmp))
                for mode in ("compiled", "eager")]
    base = rows[0]
    print(f"| sampler | first sampled request s | vs compiled | sequential request s (median "
          f"of 20) | vs compiled | {args.concurrency} concurrent s (median of {args.rounds}) "
          f"| vs compiled |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['first']:.2f} | {r['first'] / base['first']:.3f}x | "
              f"{r['sequential']:.3f} | {r['sequential'] / base['sequential']:.2f}x | "
              f"{r['concurrent']:.3f} | {r['concurrent'] / base['concurrent']:.2f}x |")


if __name__ == "__main__":
    main()
