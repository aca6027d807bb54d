"""Balancing a long-tail batch over data-parallel ranks: the straggler's time, by how rows are
assigned.

    OMP_NUM_THREADS=1 python benchmarks/rank_balance.py [--size 10m] [--ranks 2] [--rounds 3]

A GRPO-like batch with a long tail (most answers short, a few long, lengths drawn once from a
Pareto distribution, seeded) is split over `--ranks` data-parallel ranks three ways: `rows`
(equal row counts in batch order, the baseline), `tokens` (equal token counts, greedy LPT:
`actor.mb_spec.balance=tokens`) and `compute` (tokens plus each sequence's attention, which
grows with its length squared: `balance=compute`, the default). Each rank's share is trained
for one step (forward + backward, one micro-batch per rank's share) in this process, one after
the other with one thread, so no rank slows another; a real step lasts as long as its slowest
rank. The table gives each split's slowest and fastest rank (median over `--rounds`) and the
straggler time saved against `rows`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from areal_like.api.config import (  # noqa: E402
    MicroBatchSpec,
    ModelConfig,
    OptimizerConfig,
    TrainEngineConfig,
)
from engines.fsdp.engine import FSDPEngine  # noqa: E402
from engines.fsdp.packing import attention_width, dp_shard_indices, sequence_costs  # noqa: E402


def long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    """Prompt of 40 tokens + an answer from a Pareto tail: most ~60 tokens, a few thousand."""
    rng = random.Random(seed)
    return [40 + min(3000, int(20 * rng.paretovariate(0.9))) for _ in range(n)]


def batch_of(lengths: list[int], vocab: int) -> TensorDict:
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return TensorDict({"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask},
                      batch_size=[len(lengths)])


def splits(lengths: list[int], ranks: int, width: float) -> dict[str, list[list[int]]]:
    per = -(-len(lengths) // ranks)
    return {"rows": [list(range(r * per, min(len(lengths), (r + 1) * per)))
                     for r in range(ranks)],
            "tokens": dp_shard_indices([float(n) for n in lengths], ranks),
            "compute": dp_shard_indices(sequence_costs(lengths, width), ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from areal_like.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / args.size, size=args.size, seed=1)
        config = json.loads((model / "config.json").read_text())
        lengths = long_tail_lengths(args.rows)
        width = attention_width(config)
        batch = batch_of(lengths, int(config["vocab_size"]))
        engine = FSDPEngine(TrainEngineConfig(
            model=ModelConfig(path=str(model)), optimizer=OptimizerConfig(lr=0.0),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=sum(lengths))))
        engine.initialize()

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            return torch.logsumexp(logits.float(), dim=-1).mean()

        def seconds(rows: list[int]) -> float:
            began = time.perf_counter()
            engine.train_batch(batch[torch.tensor(rows)], loss_fn, lambda mb: 1.0)
            return time.perf_counter() - began

        seconds(list(range(4)))  # warm-up
        print(f"{args.rows} rows, {sum(lengths)} tokens, lengths {min(lengths)}-{max(lengths)} "
              f"(median {statistics.median(lengths):.0f}); {args.size} model, attention "
              f"width {width:.0f}; {args.ranks} ranks, median of {args.rounds} rounds")
        print("| split | tokens per rank | slowest rank s | fastest rank s | straggler saved |")
        print("|---|---|---|---|---|")
        base = 0.0
        for name, shards in splits(lengths, args.ranks, width).items():
            times = [statistics.median(seconds(s) for _ in range(args.rounds)) for s in shards]
            base = base or max(times)
            tokens = "/".join(str(sum(lengths[i] for i in s)) for s in shards)
            print(f"| {name} | {tokens} | {max(times):.2f} | {min(times):.2f} | "
                  f"{(1 - max(times) / base) * 100:.0f} % |", flush=True)
        engine.destroy()


if __name__ == "__main__":
    main()
