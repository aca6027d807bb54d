"""Asynchronous vs synchronous RL: the same GRPO recipe, seed and allocation (one SGLang server,
one trainer process, one thread each) run with eta = 0 (synchronous) and eta = 1, 2, 4.

    python benchmarks/async_speedup.py [--steps 40] [--etas 0 1 2 4] [--model DIR]

Each mode is a real run through the local launcher. Per mode it prints: wall time per step,
the trainer's wait for rollouts and its training + weight-sync time per step, the trainer's
idle fraction (waiting for data) and the rollout side's idle fraction, final held-out greedy
accuracy, and the speedup against eta = 0. Rollout idleness is estimated from the synchronous
run: there the trainer waits for the whole generation of a batch, which gives the generation
time g per batch, and the rollout side of a mode whose step takes s seconds is idle 1 - g/s.
Steps 0 and the last (evaluations) and the first 3 (pipeline fill) are left out of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_mode(eta: int, steps: int, model: Path, log_dir: Path, seed: int) -> dict[str, float]:
    trial = f"eta{eta}"
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "grpo", f"model.path={model}",
           f"rollout.max_head_offpolicyness={eta}", f"total_train_steps={steps}",
           f"evaluation.freq_steps={steps}", "evaluation.n_prompts=200",
           "checkpoint.freq_steps=0", f"logging.log_dir={log_dir}", f"logging.trial_name={trial}",
           "logging.tensorboard=false", "logging.plot=false", f"seed={seed}",
           # the optimizer these results were measured with (the main job now decays its lr)
           "actor.optimizer.lr=5e-5", "actor.optimizer.lr_scheduler_type=constant"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"eta={eta} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    path = log_dir / "grpo_addition" / trial / "metrics.jsonl"
    records = [json.loads(line) for line in path.open()]
    body = [r for r in records if 3 < r["step"] < steps]  # no fill-up, no evaluation steps
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in body)  # noqa: E731
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"eta": eta, "step_s": mean("timeperf/step"), "wait_s": mean("timeperf/rollout"),
            "train_s": mean("timeperf/train") + mean("timeperf/weight_sync"),
            "acc0": accuracy[0], "acc": accuracy[-1], "wall_s": wall,
            "staleness_max": max(r.get("rollout/staleness_max", 0) for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", type=Path, default=REPO / ".cache/models/addition-sft",
                        help="warm-start model (scripts/main.sh writes the default one)")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} is not a model folder: run `bash scripts/main.sh` once, or pass "
                 f"--model DIR")
    if 0 not in args.etas:
        sys.exit("--etas must include 0: the synchronous run is the baseline")
    with tempfile.TemporaryDirectory(prefix="async_speedup_") as tmp:
        rows = [run_mode(eta, args.steps, args.model, Path(tmp), args.seed)
                for eta in sorted(args.etas)]
    sync = rows[0]
    gen_s = sync["wait_s"]  # synchronous: the trainer waits for the whole generation
    print(f"\nGRPO on 2-digit addition, {args.steps} steps per mode, 1 SGLang server + 1 trainer "
          f"process (1 thread each); means over steps 4..{args.steps - 1}")
    print("| eta | s/step | trainer wait s/step | train+sync s/step | trainer idle | "
          "rollout idle | max staleness | accuracy start -> end | speedup vs sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        trainer_idle = r["wait_s"] / r["step_s"]
        rollout_idle = max(0.0, 1.0 - gen_s / r["step_s"])
        print(f"| {r['eta']} | {r['step_s']:.3f} | {r['wait_s']:.3f} | {r['train_s']:.3f} | "
              f"{trainer_idle:.0%} | {rollout_idle:.0%} | {r['staleness_max']:.0f} | "
              f"{r['acc0']:.3f} -> {r['acc']:.3f} | {sync['step_s'] / r['step_s']:.2f}x |")
    ideal = (gen_s + sync["train_s"]) / max(gen_s, sync["train_s"])
    print(f"\ngeneration per batch (sync wait) {gen_s:.3f} s, training + weight sync "
          f"{sync['train_s']:.3f} s: the ideal overlap speedup for these two stages is "
          f"{ideal:.2f}x")


if __name__ == "__main__":
    main()
