"""Bytes and seconds per weight sync: a LoRA adapter against the full model, per model size.

    python benchmarks/lora_sync.py [--sizes 10m 50m 100m] [--rank 16] [--rounds 3]

Per size (tiny Qwen2 models built offline) one real SGLang server is started with LoRA
serving, and an FSDPEngine (one rank, in this process) holds the trainer's copy: a full one
and a LoRA one (`rank`, every linear layer of the decoder blocks). Measured, median over
rounds, from the trainer's call to the fleet serving again
(`areal_like.runtime.weight_sync.push_weights`):
- full, `disk`: gather, write the HF folder, pause (retract), the server loads it, continue;
- full, `distributed`: pause, gather + broadcast each bucket over the server's gloo group;
- LoRA, `disk`: gather the adapter, write the PEFT folder, pause (abort), unload + load the
  adapter, continue;
- LoRA, `in memory`: gather the adapter, pause, send its tensors in the load request.
Ratios are full / LoRA, measured in the same run. The 7B row projects bytes exactly (Qwen2-7B
shapes) and seconds from this run's 100M throughput (bytes/s) of each transport: it says
how the sizes scale, not what a GPU cluster's network does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from areal_like.api.config import (  # noqa: E402
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    ServerConfig,
    TrainEngineConfig,
)
from areal_like.api.lora_config import DECODER_LINEAR_MODULES, LoRAConfig  # noqa: E402
from areal_like.api.rollout_config import WeightTransportConfig  # noqa: E402
from areal_like.models.tiny import build_tiny_model  # noqa: E402
from areal_like.runtime.weight_broadcast import WeightBroadcaster  # noqa: E402
from areal_like.runtime.weight_sync import push_weights  # noqa: E402
from engines import FSDPEngine  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from engines.fleet.updater import FleetUpdater  # noqa: E402

# Qwen2-7B: hidden, intermediate, layers, key/value width (4 heads x 128), params
QWEN2_7B = {"hidden": 3584, "inter": 18944, "layers": 28, "kv": 512, "params": 7.62e9}


def lora_params_7b(rank: int) -> int:
    h, i, kv = QWEN2_7B["hidden"], QWEN2_7B["inter"], QWEN2_7B["kv"]
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return int(QWEN2_7B["layers"]) * sum(rank * (a + b) for a, b in shapes.values())


def _median_push(engine: FSDPEngine, fleet: FleetUpdater, root: Path, rounds: int,
                 version: int, **kwargs: Any) -> tuple[float, int]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        push_weights(engine, fleet, version := version + 1, root, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), version


def measure(size: str, rank: int, rounds: int, tmp: Path) -> dict[str, Any]:
    base = build_tiny_model(tmp / f"{size}-base", size, seed=1)
    lora = LoRAConfig(rank=rank, alpha=2 * rank)
    full = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(base)),
                                        optimizer=OptimizerConfig(lr=1e-4)))
    full.initialize()
    row: dict[str, Any] = {"size": size,
                           "params_m": sum(p.numel() for p in full.model.parameters()) / 1e6,
                           "full_bytes": sum(p.nbytes for p in full.weight_specs())}
    server = ServerConfig(n_servers=1, max_total_tokens=4096, lora_rank=rank,
                          lora_target_modules=list(DECODER_LINEAR_MODULES))
    with InferenceFleet(base, server, log_dir=tmp / f"{size}-logs") as fleet:
        plain = RolloutConfig(server_addrs=fleet.addresses,
                              weights=WeightTransportConfig(transport="distributed"))
        client = RemoteInferenceEngine(plain)
        client.initialize()
        broadcaster = WeightBroadcaster(plain)
        updater = FleetUpdater(plain, client)  # trainer rank 0's, as in a run
        try:
            broadcaster.push(full, updater, 1)  # forms the group
            row["full_disk"], v = _median_push(full, updater, tmp / f"{size}-w", rounds, 1)
            row["full_dist"], v = _median_push(full, updater, tmp / f"{size}-w", rounds, v,
                                               broadcaster=broadcaster)
        finally:
            updater.close()
            broadcaster.close()
            client.destroy()
            full.destroy()
        adapted = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(base)),
                                               optimizer=OptimizerConfig(lr=1e-4), lora=lora))
        adapted.initialize()
        adapter_config = RolloutConfig(server_addrs=fleet.addresses,
                                       lora_adapter=lora.adapter_name)
        client = RemoteInferenceEngine(adapter_config)
        client.initialize()
        updater = FleetUpdater(adapter_config, client)
        try:
            adapter = adapted.adapter_weights()
            assert adapter is not None
            row["lora_bytes"] = adapter.nbytes
            row["lora_disk"], v = _median_push(adapted, updater, tmp / f"{size}-a", rounds, v)
            row["lora_mem"], v = _median_push(adapted, updater, tmp / f"{size}-a", rounds, v,
                                              in_memory=True)
        finally:
            updater.close()
            client.destroy()
            adapted.destroy()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10m", "50m", "100m"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora_sync_") as tmp:
        rows = [measure(size, args.rank, args.rounds, Path(tmp)) for size in args.sizes]
    mb = 2**20
    print(f"LoRA rank {args.rank} on {', '.join(DECODER_LINEAR_MODULES)}; fp32; median of "
          f"{args.rounds} rounds; seconds from the trainer's call to the fleet serving again")
    print("| model | full MB | LoRA MB | bytes full / LoRA | full disk s | LoRA disk s | "
          "disk full / LoRA | full distributed s | LoRA in memory s | full dist. / LoRA mem. |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} ({r['params_m']:.0f}M) | {r['full_bytes'] / mb:.1f} | "
              f"{r['lora_bytes'] / mb:.2f} | {r['full_bytes'] / r['lora_bytes']:.0f}x | "
              f"{r['full_disk']:.3f} | {r['lora_disk']:.3f} | "
              f"{r['full_disk'] / r['lora_disk']:.1f}x | {r['full_dist']:.3f} | "
              f"{r['lora_mem']:.3f} | {r['full_dist'] / r['lora_mem']:.1f}x |")
    big = rows[-1]
    full_7b, lora_7b = 4 * QWEN2_7B["params"], 4 * lora_params_7b(args.rank)
    rate = {k: big[f"{kind}_bytes"] / big[k] for k, kind in
            (("full_disk", "full"), ("full_dist", "full"), ("lora_disk", "lora"),
             ("lora_mem", "lora"))}
    print(f"| 7B (projected from {big['size']}) | {full_7b / mb:.0f} | {lora_7b / mb:.1f} | "
          f"{full_7b / lora_7b:.0f}x | {full_7b / rate['full_disk']:.1f} | "
          f"{lora_7b / rate['lora_disk']:.2f} | "
          f"{(full_7b / rate['full_disk']) / (lora_7b / rate['lora_disk']):.0f}x | "
          f"{full_7b / rate['full_dist']:.1f} | {lora_7b / rate['lora_mem']:.2f} | "
          f"{(full_7b / rate['full_dist']) / (lora_7b / rate['lora_mem']):.0f}x |")


if __name__ == "__main__":
    main()
