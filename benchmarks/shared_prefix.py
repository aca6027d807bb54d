"""Shared prefixes computed once: the trainer's step with `actor.shared_prefix` off and on.

    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py [--sizes 10m 50m] [--ratios 1 8 32]
        [--groups 4 8 16] [--answer 8] [--rounds 3]

GRPO-shaped batches: one prompt of `ratio x answer` tokens and `group` answers of `answer`
tokens each (random tokens, answers distinct from their first token on), two groups a batch,
one micro-batch. Each (size, ratio, group) runs in a fresh process, packed (the baseline) and
as a tree: `FSDPEngine.train_batch` (forward, backward, clip, AdamW) timed `--rounds` times after
one warm-up step, the median reported with tokens/s over the batch's (unshared) tokens and the
process's peak resident memory. `--forced` also times the tree where the engine would pack the
micro-batch whole (its tree keeps more than the break-even share of the tokens), which is how
the break-even was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _batch(ratio: int, group: int, answer: int, n_groups: int, vocab: int, seed: int):  # noqa: ANN202
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    prompt_len = ratio * answer
    rows = []
    for _ in range(n_groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen)
        firsts = torch.randperm(vocab - 3, generator=gen)[:group] + 3  # distinct first tokens
        for first in firsts.tolist():
            rest = torch.randint(3, vocab, (answer - 1,), generator=gen)
            rows.append(torch.cat([prompt, torch.tensor([first]), rest]))
    ids = torch.stack(rows)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_len:] = 1
    return TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "loss_mask": loss_mask}, batch_size=[len(rows)])


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from areal_like.api.config import (
        MicroBatchSpec,
        ModelConfig,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal_like.models.tiny import build_tiny_model
    from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
    from engines.fsdp.engine import FSDPEngine

    torch.set_num_threads(1)
    model_dir = build_tiny_model(Path(args.model_root) / args.size, size=args.size, seed=1)
    vocab = 512 if args.size == "1m" else 1024
    batch = _batch(args.ratio, args.group, args.answer, 2, vocab,
                   seed=args.ratio * 100 + args.group)

    def loss_fn(logits: torch.Tensor, mb) -> torch.Tensor:  # noqa: ANN001
        mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()
        return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum().clamp(min=1)

    def weight(mb) -> torch.Tensor:  # noqa: ANN001
        return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).sum()

    engine = FSDPEngine(TrainEngineConfig(
        model=ModelConfig(path=str(model_dir)), optimizer=OptimizerConfig(lr=1e-5),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=1 << 20), shared_prefix=args.mode != "packed"))
    engine.initialize()
    if args.mode == "forced":
        engine._trees.break_even = 1.0  # a tree whatever it saves
    times, stats = [], {}
    for i in range(args.rounds + 1):
        start = time.perf_counter()
        stats = engine.train_batch(batch, loss_fn, weight)
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    engine.destroy()
    step = statistics.median(times)
    return {"step_s": step, "tokens": stats["n_tokens"],
            "forwarded": stats.get("n_forwarded_tokens", stats["n_tokens"]),
            "tokens_per_s": stats["n_tokens"] / step,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _measure(size: str, ratio: int, group: int, mode: str, args: argparse.Namespace,
             root: str) -> dict:
    cmd = [sys.executable, __file__, "--one", "--size", size, "--ratio", str(ratio),
           "--group", str(group), "--mode", mode, "--answer", str(args.answer),
           "--rounds", str(args.rounds), "--model-root", root]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10m", "50m"])
    parser.add_argument("--ratios", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--answer", type=int, default=8, help="answer tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forced", action="store_true",
                        help="also time the tree where the engine would pack whole")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="10m", help=argparse.SUPPRESS)
    parser.add_argument("--ratio", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="packed", help=argparse.SUPPRESS)
    parser.add_argument("--model-root", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    modes = ["packed", "tree"] + (["forced"] if args.forced else [])
    print("| size | prompt : answer | group | tokens | forwarded | packed s/step | tree s/step "
          "| tree vs packed | tokens/s packed / tree | peak RSS MB packed / tree |"
          + (" forced tree s/step |" if args.forced else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.forced else ""))
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes:
            for ratio in args.ratios:
                for group in args.groups:
                    r = {m: _measure(size, ratio, group, m, args, root) for m in modes}
                    p, t = r["packed"], r["tree"]
                    line = (f"| {size} | {ratio}:1 | {group} | {p['tokens']:.0f} | "
                            f"{t['forwarded']:.0f} | {p['step_s']:.3f} | {t['step_s']:.3f} | "
                            f"{t['step_s'] / p['step_s']:.2f}x | {p['tokens_per_s']:.0f} / "
                            f"{t['tokens_per_s']:.0f} | {p['peak_rss_mb']:.0f} / "
                            f"{t['peak_rss_mb']:.0f} |")
                    if args.forced:
                        line += f" {r['forced']['step_s']:.3f} |"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
