"""Packed attention: one SDPA call per sequence against calls batched by length.

    OMP_NUM_THREADS=1 python benchmarks/packed_attention.py [--rounds 20]

One layer's attention (4 query heads, 2 key/value heads, head size 32: the tiny models'),
forward and backward, through `engines.fsdp.attention.packed_sdpa_attention` on three packs:
a GRPO batch of the main job (128 answers of 20-22 tokens), 128 lengths spread 11-60, and 32
all-different lengths 11-281. `per-sequence` (the baseline) forces one call per sequence;
`bucketed` is what the engine does (it keeps per-sequence calls where buckets would not halve
them). Median milliseconds over `--rounds`, ratio to the baseline of the same pack.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engines.fsdp import attention  # noqa: E402


def packs() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {"GRPO batch (128 x 20-22)": [20 + i % 3 for i in range(128)],
            "128 spread 11-60": [rng.randint(11, 60) for _ in range(128)],
            "32 distinct 11-281": rng.sample(range(11, 282), 32)}


def time_pack(lengths: list[int], rounds: int, per_sequence: bool) -> float:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    q = torch.randn(1, 4, total, 32, requires_grad=True)
    k, v = (torch.randn(1, 2, total, 32, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, total, 4, 32)
    module = types.SimpleNamespace(training=True)
    patch = mock.patch.object(attention, "bucket_plan", lambda cu: None) if per_sequence \
        else mock.patch.object(attention, "bucket_plan", attention.bucket_plan)
    times = []
    with patch:
        for i in range(rounds + 2):
            began = time.perf_counter()
            out, _ = attention.packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu)
            out.backward(grad)
            if i >= 2:  # warm-up rounds left out
                times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| pack | per-sequence (baseline) ms | bucketed ms | vs baseline |")
    print("|---|---|---|---|")
    for name, lengths in packs().items():
        base = time_pack(lengths, args.rounds, per_sequence=True)
        mine = time_pack(lengths, args.rounds, per_sequence=False)
        print(f"| {name} | {base:.1f} | {mine:.1f} | {mine / base:.2f}x |")


if __name__ == "__main__":
    main()
