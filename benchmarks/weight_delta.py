"""Delta weight sync: bytes sent and seconds to the fleet serving again, delta against full
disk and full process-group broadcast, per model size and learning-rate regime.

    python benchmarks/weight_delta.py [--sizes 10m 50m 100m] [--rounds 2]
        [--regimes fp32:1.5e-4 fp32:1.5e-5 bf16:1.5e-4 bf16:1.5e-5]

Per model size (tiny Qwen2 models built offline) and regime (`dtype:lr`: the trainer's and
the server's dtype, AdamW's learning rate; 1.5e-4 is the main job's), one real SGLang
server is started and an FSDPEngine (one rank, in this process) trains. Each transport gets
`rounds` updates, each after one real optimizer step (AdamW on a next-token loss over random
tokens), and is timed as the trainer sees it (`push_weights`: from the trainer's call to the
fleet serving again):
- `delta xor` / `delta sparse`: a weight file of what changed since the server's version
  (rollout.weights.transport=delta, either codec), after one full file that gives the
  server its base;
- `disk`: the HF folder (rollout.weights.transport=disk);
- `broadcast`: the process-group transport (gloo here), its group formed before the rounds.
Bytes: the delta file, the folder's files, the broadcast's buckets. Ratios are full / delta,
in the same run. The last row projects bytes exactly to Qwen2-7B (7.62e9 parameters) at the
largest size's measured file ratio, and seconds at each transport's measured bytes/s.
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

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

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
from areal_like.runtime.weight_delta import WeightDeltaPusher  # noqa: E402
from areal_like.runtime.weight_sync import push_weights  # noqa: E402
from engines import FSDPEngine  # noqa: E402
from engines.fleet.client import RemoteInferenceEngine  # noqa: E402
from engines.fleet.launch import InferenceFleet  # noqa: E402
from engines.fleet.updater import FleetUpdater  # noqa: E402

QWEN2_7B_PARAMS = 7.62e9


def train_step(engine: FSDPEngine, seed: int) -> None:
    """One AdamW step on a next-token loss over random tokens (every parameter gets a
    gradient, as in RL)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (4, 64), generator=gen)
    ones = torch.ones_like(ids)
    batch = TensorDict({"input_ids": ids, "attention_mask": ones, "loss_mask": ones},
                       batch_size=[4])

    def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        logp = torch.log_softmax(logits.float()[:-1], dim=-1)
        target = mb["input_ids"].view(-1)[1:]
        return -logp.gather(-1, target[:, None]).mean()

    engine.train_batch(batch, loss_fn, lambda mb: 1.0)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def measure(size: str, dtype: str, lr: float, rounds: int, tmp: Path) -> dict[str, Any]:
    base = build_tiny_model(tmp / f"{size}-base", size, seed=1)
    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(base), dtype=dtype),
                                          optimizer=OptimizerConfig(lr=lr)))
    engine.initialize()
    raw = sum(p.nbytes for p in engine.weight_specs())
    row: dict[str, Any] = {"size": size, "dtype": dtype, "lr": lr, "raw": raw,
                           "params_m": sum(p.numel() for p in engine.model.parameters()) / 1e6}
    seed = 0
    try:
        with InferenceFleet(base, ServerConfig(n_servers=1, max_total_tokens=4096, dtype=dtype),
                            log_dir=tmp / f"{size}-{dtype}-{lr}-logs") as fleet:
            config = RolloutConfig(server_addrs=fleet.addresses, weights=WeightTransportConfig(
                transport="delta", bucket_mb=256.0))
            client = RemoteInferenceEngine(config)
            client.initialize()
            updater = FleetUpdater(config, client)
            version = 0
            try:
                for codec in ("xor", "sparse"):
                    config.weights.delta_codec = codec
                    pusher = WeightDeltaPusher(config, tmp / f"{size}-{dtype}-{lr}-{codec}")
                    pusher.push(engine, updater, version := version + 1)  # the base: full
                    seconds, sizes, changed = [], [], []
                    for _ in range(rounds):
                        train_step(engine, seed := seed + 1)
                        start = time.perf_counter()
                        stats = pusher.push(engine, updater, version := version + 1)
                        seconds.append(time.perf_counter() - start)
                        sizes.append(stats["weight_sync/file_bytes"])
                        changed.append(stats["weight_sync/changed_fraction"])
                    row[codec] = statistics.median(seconds)
                    row[f"{codec}_bytes"] = statistics.median(sizes)
                    row["changed"] = statistics.median(changed)
                assert updater.delta_loader.counts["delta"] == 2 * rounds, \
                    updater.delta_loader.counts  # every round applied as a delta
                disk, disk_bytes = [], []
                for _ in range(rounds):
                    train_step(engine, seed := seed + 1)
                    start = time.perf_counter()
                    push_weights(engine, updater, version := version + 1, tmp / f"{size}-w")
                    disk.append(time.perf_counter() - start)
                    disk_bytes.append(folder_bytes(tmp / f"{size}-w" / f"v{version}"))
                row["disk"], row["disk_bytes"] = statistics.median(disk), statistics.median(
                    disk_bytes)
                config.weights.transport = "distributed"
                broadcaster = WeightBroadcaster(config)
                try:
                    broadcaster.push(engine, updater, version := version + 1)  # forms the group
                    times = []
                    for _ in range(rounds):
                        train_step(engine, seed := seed + 1)
                        start = time.perf_counter()
                        broadcaster.push(engine, updater, version := version + 1)
                        times.append(time.perf_counter() - start)
                    row["broadcast"] = statistics.median(times)
                finally:
                    broadcaster.close()
            finally:
                updater.close()
                client.destroy()
    finally:
        engine.destroy()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10m", "50m", "100m"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--regimes", nargs="+",
                        default=["fp32:1.5e-4", "fp32:1.5e-5", "bf16:1.5e-4", "bf16:1.5e-5"])
    args = parser.parse_args()
    dtypes = {"fp32": "float32", "bf16": "bfloat16"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight_delta_") as tmp:
        for size in args.sizes:
            for regime in args.regimes:
                dtype, lr = regime.split(":")
                rows.append(measure(size, dtypes[dtype], float(lr), args.rounds, Path(tmp)))
                r = rows[-1]
                print(f"[weight_delta] {size} {dtype} lr={lr}: changed {r['changed']:.3f}, "
                      f"xor {r['xor_bytes'] / r['raw']:.3f} of the bytes", flush=True)
    mb = 2**20
    print(f"median of {args.rounds} rounds; seconds from the trainer's call to the fleet "
          "serving again (one SGLang server); bytes: what travels to each server")
    print("| model | dtype | lr | elements changed | full MB (broadcast) | disk MB | "
          "delta xor MB | delta sparse MB | full / delta bytes | broadcast s | disk s | "
          "delta xor s | delta sparse s | disk / delta s | broadcast / delta s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = min(r["xor_bytes"], r["sparse_bytes"])
        fast = min(r["xor"], r["sparse"])
        print(f"| {r['size']} ({r['params_m']:.0f}M) | {r['dtype']} | {r['lr']:g} | "
              f"{100 * r['changed']:.1f} % | {r['raw'] / mb:.1f} | {r['disk_bytes'] / mb:.1f} | "
              f"{r['xor_bytes'] / mb:.2f} | {r['sparse_bytes'] / mb:.2f} | "
              f"{r['raw'] / best:.1f}x | {r['broadcast']:.2f} | {r['disk']:.2f} | "
              f"{r['xor']:.2f} | {r['sparse']:.2f} | {r['disk'] / fast:.2f}x | "
              f"{r['broadcast'] / fast:.2f}x |")
    big = [r for r in rows if r["size"] == args.sizes[-1]]
    for r in big:
        full = QWEN2_7B_PARAMS * (2 if r["dtype"] == "bfloat16" else 4)
        best = min(r["xor_bytes"], r["sparse_bytes"])
        delta = full * best / r["raw"]
        rate = {k: (r["raw"] if k != "delta" else best) / r[k if k != "delta" else (
            "xor" if r["xor_bytes"] <= r["sparse_bytes"] else "sparse")]
            for k in ("broadcast", "disk", "delta")}
        print(f"| 7B (projected from {r['size']}) | {r['dtype']} | {r['lr']:g} | "
              f"{100 * r['changed']:.1f} % | {full / mb:.0f} | {full / mb:.0f} | "
              f"{delta / mb:.0f} | - | {full / delta:.1f}x | {full / rate['broadcast']:.1f} | "
              f"{full / rate['disk']:.1f} | {delta / rate['delta']:.1f} | - | "
              f"{(full / rate['disk']) / (delta / rate['delta']):.1f}x | "
              f"{(full / rate['broadcast']) / (delta / rate['delta']):.1f}x |")


if __name__ == "__main__":
    main()
