"""Weight-update latency: the fleet's pause -> load -> resume against the bare cost of writing
and reading the same safetensors.

    python benchmarks/weight_update.py [--sizes 1m 10m 50m] [--rounds 3]

Per model size (tiny Qwen2 models built offline) one real SGLang server is started. Measured,
median over rounds: `write` = `save_pretrained` of the weights as safetensors (what the trainer's
export costs at minimum), `read` = `safetensors.torch.load_file` of that file, and `update` =
`RemoteSGLangEngine.update_weights` from that folder, i.e. pause (retract) + the server loading
the folder + continue, as the trainer sees it. The ratio update / (write + read) shows what the
HTTP round trips and SGLang's own loading add over the bare file I/O.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from areal_like.api import WeightUpdateMeta  # noqa: E402
from areal_like.api.config import RolloutConfig, SGLangServerConfig  # noqa: E402
from areal_like.models.tiny import build_tiny_model  # noqa: E402
from engines.remote_sglang import RemoteSGLangEngine  # noqa: E402
from engines.sglang_server import SGLangFleet  # noqa: E402


def measure(size: str, rounds: int, tmp: Path) -> dict[str, float]:
    base = build_tiny_model(tmp / f"{size}-base", size, seed=1)
    model = AutoModelForCausalLM.from_pretrained(base)
    n_params = sum(p.numel() for p in model.parameters())
    writes, reads, updates = [], [], []
    with SGLangFleet(base, SGLangServerConfig(n_servers=1), log_dir=tmp / f"{size}-logs") as fleet:
        engine = RemoteSGLangEngine(RolloutConfig(server_addrs=fleet.addresses))
        engine.initialize()
        try:
            for r in range(rounds):
                out = tmp / f"{size}-v{r + 1}"
                start = time.perf_counter()
                model.save_pretrained(out, safe_serialization=True)
                writes.append(time.perf_counter() - start)
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    (out / name).write_bytes((base / name).read_bytes())
                start = time.perf_counter()
                load_file(out / "model.safetensors")
                reads.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.update_weights(WeightUpdateMeta.from_disk(str(out), r + 1))
                updates.append(time.perf_counter() - start)
        finally:
            engine.destroy()
    size_mb = (tmp / f"{size}-v1" / "model.safetensors").stat().st_size / 2**20
    return {"size": size, "params_m": n_params / 1e6, "mb": size_mb,
            "write": statistics.median(writes), "read": statistics.median(reads),
            "update": statistics.median(updates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1m", "10m", "50m"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weight_update_") as tmp:
        rows = [measure(size, args.rounds, Path(tmp)) for size in args.sizes]
    print("| model | params | safetensors | write s | read s | write+read s (baseline) | "
          "pause->load->resume s | vs baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        bare = r["write"] + r["read"]
        print(f"| {r['size']} | {r['params_m']:.1f}M | {r['mb']:.1f} MB | {r['write']:.3f} | "
              f"{r['read']:.3f} | {bare:.3f} | {r['update']:.3f} | {r['update'] / bare:.2f}x |")


if __name__ == "__main__":
    main()
