"""Memory you can plan: peak resident memory per rank and step time of one long-sequence
training step, by sequence-parallel size and activation checkpointing.

    OMP_NUM_THREADS=1 python benchmarks/trainer_memory.py [--tokens 4096] [--sizes 10m 50m]

For each model size, one `torchrun --nproc_per_node=SP` job per layout (SP = 1 / 2 / 4,
checkpointing off / on): an FSDPEngine with `actor.parallel.sequence_parallel_size=SP` trains
on a batch of `--sequences` sequences totalling `--tokens` tokens packed into one micro-batch
(one warm-up step, then `--steps` measured ones). Per rank it reads the peak resident set
(Linux VmHWM, reset through /proc/self/clear_refs before each step) and subtracts what was
resident before the step: the step's own memory (activations, logits, gradients in flight),
the part sequence parallelism divides. So that resident memory is live memory, glibc maps
every allocation over 128 KiB on its own (`MALLOC_MMAP_THRESHOLD_`: freed tensors go back to
the system at once) and `malloc_trim` returns the rest before each step. The table gives the
largest rank's value, the step's wall time, and ratios against SP = 1 without checkpointing
of the same run. Offloading
(`cpu_offload`, `activation_offload`) moves GPU memory to the host: on this CPU there is none
to move (the engine refuses it), so it has no row here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a layout's job (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict

    from areal_like.api.config import (
        MicroBatchSpec,
        ModelConfig,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal_like.api.parallel_config import ParallelConfig
    from engines.fsdp.engine import FSDPEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = TrainEngineConfig(
        model=ModelConfig(path=args.model), optimizer=OptimizerConfig(lr=1e-5),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=args.tokens),
        parallel=ParallelConfig(sequence_parallel_size=dist.get_world_size()),
        gradient_checkpointing=args.checkpointing)
    engine = FSDPEngine(config)
    engine.initialize()
    gen = torch.Generator().manual_seed(0)
    length = args.tokens // args.sequences
    ids = torch.randint(3, 1000, (args.sequences, length), generator=gen)
    ones = torch.ones_like(ids)
    batch = TensorDict({"input_ids": ids, "attention_mask": ones, "loss_mask": ones},
                       batch_size=[args.sequences])

    def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        return torch.logsumexp(logits.float(), dim=-1).mean()

    libc = ctypes.CDLL("libc.so.6")
    rows = []
    for step in range(args.steps + 1):
        libc.malloc_trim(0)  # what earlier steps freed leaves the resident set
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current resident set
        before = _resident_kib("VmRSS")
        dist.barrier()
        began = time.perf_counter()
        engine.train_batch(batch, loss_fn, lambda mb: 1.0)
        seconds = time.perf_counter() - began
        if step > 0:  # the first step allocates the optimizer state
            rows.append({"step_mib": (_resident_kib("VmHWM") - before) / 1024,
                         "seconds": seconds})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    engine.destroy()


def run_layout(model: Path, sp: int, checkpointing: bool, args: argparse.Namespace,
               out: Path) -> dict[str, float]:
    from areal_like.utils.network import find_free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}",
           "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()), __file__,
           "--rank-job", "--model", str(model), "--out", str(out), "--tokens", str(args.tokens),
           "--sequences", str(args.sequences), "--steps", str(args.steps)]
    if checkpointing:
        cmd.append("--checkpointing")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"SP={sp} checkpointing={checkpointing} failed:\n{proc.stderr[-4000:]}")
    ranks = json.loads(out.read_text())
    per_rank_peak = [max(r["step_mib"] for r in rows) for rows in ranks]
    seconds = sorted(r["seconds"] for rows in ranks for r in rows)
    return {"step_mib": max(per_rank_peak), "seconds": seconds[len(seconds) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10m", "50m"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_main(args)
        return
    from areal_like.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        print(f"one step on {args.sequences} sequences x {args.tokens // args.sequences} "
              f"tokens (one packed micro-batch); step MiB = peak resident during the step "
              f"minus resident before it, largest rank; median seconds over ranks and steps")
        print("| model | SP | checkpointing | step MiB per rank | ratio | s/step | ratio |")
        print("|---|---|---|---|---|---|---|")
        for size in args.sizes:
            model = build_tiny_model(Path(tmp) / size, size=size, seed=1)
            base: dict[str, float] = {}
            for checkpointing in (False, True):
                for sp in args.sp:
                    got = run_layout(model, sp, checkpointing, args, Path(tmp) / "out.json")
                    base = base or got
                    print(f"| {size} | {sp} | {'on' if checkpointing else 'off'} | "
                          f"{got['step_mib']:.0f} | {got['step_mib'] / base['step_mib']:.2f} | "
                          f"{got['seconds']:.2f} | {got['seconds'] / base['seconds']:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
