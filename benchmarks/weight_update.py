"""Weight-update latency, disk vs the distributed transport, against the bare broadcast.

    python benchmarks/weight_update.py [--sizes 1m 10m 50m 100m] [--rounds 3] [--bucket-mb 256]

Per model size (tiny Qwen2 models built offline) one real SGLang server is started and an
FSDPEngine (one rank, in this process) holds the trainer's copy. Measured, median over rounds,
as the trainer sees it (`areal_like.runtime.weight_sync.push_weights`):
- `disk`: gather the weights, write the HF folder, then pause (retract) -> the server loads
  the folder -> continue (generation pauses only for the last part, shown in brackets);
- `distributed`: pause -> per bucket gather + broadcast over the server's gloo group while the
  server receives and loads it -> continue (the group is formed once, before the rounds;
  generation pauses for all of it);
- `floor`: a bare gloo broadcast of the same buckets from this process to a child process
  (no SGLang, no HTTP, nothing loaded): what moving the bytes costs at minimum.
The ratios show what the transport adds over the floor, and how much faster than disk it is.
`--paused-loop spin wait` measures each size twice: with SGLang's own paused scheduler (a busy
loop, `AREAL_LIKE_SGLANG_PAUSED_SPIN=1`) and with the shim's (it waits on its sockets), and
`--busy N` runs N CPU-bound processes beside it all (a shared machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from areal_like.api.config import (  # noqa: E402
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    ServerConfig,
    TrainEngineConfig,
)
from areal_like.api.rollout_config import WeightTransportConfig  # noqa: E402
from areal_like.models.tiny import build_tiny_model  # noqa: E402
from areal_like.runtime.weight_broadcast import WeightBroadcaster  # noqa: E402
from areal_like.runtime.weight_sync import push_weights  # noqa: E402
from engines import FSDPEngine  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from engines.fleet.updater import FleetUpdater  # noqa: E402
from engines.weight_transport.process_group_trainer import (
    WeightUpdateGroup,
    flatten_bucket,
    host_store,
    plan_buckets,
)


def _receiver(port: int, sizes: list[int], rounds: int) -> None:
    """The floor's other end: join like an SGLang server does, receive every bucket."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2,
                                  timeout=timedelta(seconds=120)))
    pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore("floor", store),
                                      group_name="floor", backend_options=None,
                                      timeout=timedelta(seconds=120))
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    for _ in range(rounds):
        for n in sizes:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=pg)


def floor_seconds(engine: FSDPEngine, bucket_bytes: int, rounds: int) -> float:
    buckets = plan_buckets(engine.weight_specs(), bucket_bytes)
    flats = [flatten_bucket(t, torch.device("cpu"))
             for t in engine.iter_weight_buckets(buckets) if t is not None]
    store, port = host_store("127.0.0.1", 120)
    child = mp.get_context("spawn").Process(
        target=_receiver, args=(port, [f.numel() for f in flats], rounds))
    child.start()
    group = WeightUpdateGroup("floor", store, 2, "gloo", 120)
    group.connect()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for flat in flats:
            group.start_broadcast(flat).wait()
        times.append(time.perf_counter() - start)
    child.join(60)
    group.destroy()
    return statistics.median(times)


def measure(size: str, rounds: int, bucket_mb: float, tmp: Path,
            paused_loop: str = "wait", backend: str = "sglang") -> dict[str, float]:
    base = build_tiny_model(tmp / f"{size}-base", size, seed=1)
    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(base)),
                                          optimizer=OptimizerConfig(lr=1e-4)))
    engine.initialize()
    n_params = sum(p.numel() for p in engine.model.parameters())
    nbytes = sum(p.nbytes for p in engine.weight_specs())
    config = RolloutConfig(backend=backend, weights=WeightTransportConfig(
        transport="distributed", bucket_mb=bucket_mb))
    result: dict[str, Any] = {"size": size, "params_m": n_params / 1e6, "mb": nbytes / 2**20,
                              "paused_loop": paused_loop, "backend": backend}
    os.environ["AREAL_LIKE_SGLANG_PAUSED_SPIN"] = "1" if paused_loop == "spin" else "0"
    try:
        with InferenceFleet(base, ServerConfig(backend=backend, n_servers=1,
                                                  max_total_tokens=4096),
                         log_dir=tmp / f"{size}-{paused_loop}-logs") as fleet:
            config.server_addrs = fleet.addresses
            client = RemoteInferenceEngine(config)
            client.initialize()
            broadcaster = WeightBroadcaster(config)
            updater = FleetUpdater(config, client)  # trainer rank 0's, as in a run
            try:
                version = 0
                broadcaster.push(engine, updater, version := version + 1)  # forms the group
                disk, disk_paused, distributed = [], [], []
                for _ in range(rounds):
                    start = time.perf_counter()
                    stats = push_weights(engine, updater, version := version + 1,
                                         tmp / f"{size}-w")
                    disk.append(time.perf_counter() - start)
                    disk_paused.append(stats["weight_sync/load_s"])
                    start = time.perf_counter()
                    broadcaster.push(engine, updater, version := version + 1)
                    distributed.append(time.perf_counter() - start)
            finally:
                updater.close()
                broadcaster.close()
                client.destroy()
        result |= {"disk": statistics.median(disk),
                   "disk_paused": statistics.median(disk_paused),
                   "distributed": statistics.median(distributed),
                   "buckets": float(len(plan_buckets(engine.weight_specs(),
                                                     int(bucket_mb * 2**20))))}
        result["floor"] = floor_seconds(engine, int(bucket_mb * 2**20), rounds)
    finally:
        engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1m", "10m", "50m", "100m"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--paused-loop", nargs="+", choices=["wait", "spin"], default=["wait"])
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside it")
    parser.add_argument("--backends", nargs="+", choices=["sglang", "vllm"], default=["sglang"])
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="weight_update_") as tmp:
            rows = [measure(size, args.rounds, args.bucket_mb, Path(tmp), loop, backend)
                    for size in args.sizes for backend in args.backends
                    for loop in args.paused_loop]
    finally:
        for proc in busy:
            proc.kill()
    print(f"bucket {args.bucket_mb:g} MB, median of {args.rounds} rounds, seconds from the "
          f"trainer's call to the fleet resuming, {args.busy} busy processes beside it")
    print("| model | backend | params | fp32 weights | paused scheduler | buckets | "
          "floor: bare gloo "
          "broadcast s | distributed s | vs floor | disk s (of which fleet paused) | "
          "disk / distributed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['backend']} | {r['params_m']:.1f}M | {r['mb']:.1f} MB | "
              f"{r['paused_loop']} | "
              f"{r['buckets']:.0f} | "
              f"{r['floor']:.3f} | {r['distributed']:.3f} | "
              f"{r['distributed'] / r['floor']:.2f}x | {r['disk']:.3f} "
              f"({r['disk_paused']:.3f}) | "
              f"{r['disk'] / r['distributed']:.1f}x |")


if __name__ == "__main__":
    main()
