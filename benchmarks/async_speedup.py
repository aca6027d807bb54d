"""Asynchronous vs synchronous RL: the same GRPO recipe, seed and allocation (one SGLang server,
one trainer process, one thread each) run with eta = 0 (synchronous) and eta = 1, 2, 4.

    python benchmarks/async_speedup.py [key=value ...] [--steps 40] [--etas 0 1 2 4] [--seeds 1 2]
                                       [--model DIR]

(key=value overrides come first: the lists of --etas and --seeds would take them.)
A long-tail workload: a warm start made with `train_dataset.task_kwargs.worked_fraction=0.1`
(one SFT target in ten written out column by column, ~13x longer than the bare sum) samples long
answers now and then at any prompt, as reasoning models do; run it with room for them and a
frozen policy, so every mode sees the same length distribution:

    python -m recipes.sft model.path=.cache/models/tiny-1m \
        train_dataset.task_kwargs.worked_fraction=0.1 logging.log_dir=.cache/runs \
        logging.trial_name=worked
    python benchmarks/async_speedup.py gconfig.max_new_tokens=64 actor.optimizer.lr=0 \
        --model .cache/runs/sft_addition/worked/final --steps 30 --etas 0 2 4

Each mode is a real run through the local launcher (extra `key=value` overrides go to every
mode). Per mode it prints, per step: wall time, the trainer's wait for rollouts, its training
time and weight-sync time, the trainer's slowdown against the synchronous run (its own work
with rollouts overlapping / alone), the trainer's and the rollout side's idle fractions, final
held-out greedy accuracy, the share of groups dropped as stale (they ended more than eta
versions behind), answer lengths trained on (tokens: the mean, and the mean of each step's
longest), the speedup against eta = 0 and that speedup as a fraction of the
pipeline limit (and of the limit the cores set: all processes' CPU seconds per step in the
synchronous run, divided by the number of cores, is the shortest an overlapped step can be).
Stage times come from the synchronous run: there the trainer waits for the
whole generation of a batch (T_gen) and then trains and syncs alone (T_train), so two
overlapped stages can at best give (T_gen + T_train) / max(T_gen, T_train); the rollout side
of a mode whose step takes s seconds is idle 1 - T_gen / s. A second table gives the CPU
seconds per step of every process by role (`process_cpu.py`), so a reader sees who takes the
cores. Steps 0..3 (pipeline fill) and the last are left out of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from process_cpu import ProcessCPU  # noqa: E402

from areal_like.utils.metrics_logger import read_metrics  # noqa: E402

ROLES = ["trainer", "rollout controller", "reward workers", "server scheduler",
         "server HTTP/tokenizer", "server detokenizer", "server (other)", "launcher/torchrun"]


def run_mode(eta: int, steps: int, model: Path, log_dir: Path, seed: int,
             extra: list[str]) -> dict[str, float]:
    trial = f"eta{eta}"
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "grpo", f"model.path={model}",
           f"rollout.staleness.max_head_offpolicyness={eta}", f"total_train_steps={steps}",
           f"evaluation.freq_steps={steps}", "evaluation.n_prompts=200",
           "checkpoint.freq_steps=0", f"logging.log_dir={log_dir}", f"logging.trial_name={trial}",
           "logging.tensorboard=false", "logging.plot=false", f"seed={seed}",
           # the optimizer these results were measured with (the main job now decays its lr)
           "actor.optimizer.lr=5e-5", "actor.optimizer.lr_scheduler_type=constant", *extra]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
        metrics = log_dir / "grpo_addition" / trial / "metrics.jsonl"
        marks: dict[int, dict[str, float]] = {}  # CPU by role when step 4 / the last is logged
        try:
            with ProcessCPU(proc.pid) as cpu:
                while proc.poll() is None:
                    logged = _last_step(metrics)
                    for mark in (4, steps - 1):
                        if logged >= mark and mark not in marks:
                            cpu.sample()
                            marks[mark] = cpu.by_role()
                    time.sleep(0.2)
                code = proc.returncode
        finally:  # interrupted: the launcher stops its fleet and trainer on SIGTERM
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=120)
        out.seek(0)
        if code != 0:
            raise RuntimeError(f"eta={eta} failed:\n{out.read()[-4000:]}")
    wall = time.perf_counter() - start
    records = read_metrics(log_dir / "grpo_addition" / trial / "metrics.jsonl")
    body = [r for r in records if 3 < r["step"] < steps]  # no fill-up, no last step
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in body)  # noqa: E731
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"eta": eta, "step_s": mean("timeperf/step"), "wait_s": mean("timeperf/rollout"),
            "train_s": mean("timeperf/train"), "sync_s": mean("timeperf/weight_sync"),
            "acc0": accuracy[0], "acc": accuracy[-1], "wall_s": wall,
            "len_avg": mean("actor/response_length/avg"),
            "len_max": mean("actor/response_length/max"),
            "staleness_max": max(r.get("rollout/staleness_max", 0) for r in records),
            # a group that ends more than eta versions behind is dropped, not trained on
            "dropped": max(r.get("rollout/dropped_stale_total", 0) for r in records)
            / max(1.0, max(r.get("rollout/accepted_total", 0) for r in records)),
            "cpu": {role: (marks[steps - 1].get(role, 0.0) - marks[4].get(role, 0.0))
                    / (steps - 1 - 4) for role in marks[steps - 1]}}


def _last_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1],
                        help="one full set of modes per seed, then a summary over seeds")
    parser.add_argument("overrides", nargs="*", help="key=value for every mode's recipe")
    parser.add_argument("--model", type=Path, default=REPO / ".cache/models/addition-sft",
                        help="warm-start model (scripts/main.sh writes the default one)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed run stops its mode
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} is not a model folder: run `bash scripts/main.sh` once, or pass "
                 f"--model DIR")
    if 0 not in args.etas:
        sys.exit("--etas must include 0: the synchronous run is the baseline")
    speedups: dict[int, list[tuple[float, float, float, float]]] = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="async_speedup_") as tmp:
            rows = [run_mode(eta, args.steps, args.model, Path(tmp), seed, args.overrides)
                    for eta in sorted(args.etas)]
        for eta, ratios in report(rows, args, seed).items():
            speedups.setdefault(eta, []).append(ratios)
    if len(args.seeds) > 1:
        print(f"\nOver seeds {' '.join(map(str, args.seeds))}: mean (min..max)")
        print("| eta | speedup | of limit | of limit with cores | final accuracy |")
        print("|---|---|---|---|---|")
        for eta, runs in speedups.items():
            cells = []
            for i, fmt in enumerate(("{:.2f}x", "{:.0%}", "{:.0%}", "{:.3f}")):
                vals = [r[i] for r in runs]
                cells.append(f"{fmt.format(statistics.fmean(vals))} "
                             f"({fmt.format(min(vals))}..{fmt.format(max(vals))})")
            print(f"| {eta} | " + " | ".join(cells) + " |")


def report(rows: list[dict], args: argparse.Namespace, seed: int
           ) -> dict[int, tuple[float, float, float, float]]:
    """Print one seed's tables; returns eta -> (speedup, of limit, of cores limit, accuracy)."""
    sync = rows[0]
    gen_s = sync["wait_s"]  # synchronous: the trainer waits for the whole generation
    alone_s = sync["train_s"] + sync["sync_s"]  # ... and then trains and syncs alone
    limit = (gen_s + alone_s) / max(gen_s, alone_s)
    # Overlap cannot beat the machine either: every process's CPU per step spread over the cores
    cores = len(os.sched_getaffinity(0))
    cpu_s = sum(sync["cpu"].values())
    cpu_limit = sync["step_s"] / max(gen_s, alone_s, cpu_s / cores)
    print(f"\nGRPO on 2-digit addition, seed {seed}, {args.steps} steps per mode, 1 SGLang server "
          f"+ 1 trainer process (1 thread each); means over steps 4..{args.steps - 1}; "
          f"overrides: {' '.join(args.overrides) or 'none'}")
    print(f"stages (sync run): T_gen {gen_s:.3f} s, T_train {sync['train_s']:.3f} s + weight "
          f"sync {sync['sync_s']:.3f} s; pipeline limit (T_gen + T_train) / max = {limit:.2f}x")
    print(f"CPU (sync run): {cpu_s:.2f} CPU-s per step on {cores} cores, so an overlapped step "
          f"takes >= {cpu_s / cores:.3f} s; limit with the cores counted = {cpu_limit:.2f}x")
    print("| eta | s/step | wait | train | weight sync | trainer slowdown | trainer idle | "
          "rollout idle | max staleness | dropped stale | answer tokens avg / max | "
          "accuracy start -> end | "
          "wall s | speedup | of limit | of limit with cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for r in rows:
        speedup = sync["step_s"] / r["step_s"]
        ratios[r["eta"]] = (speedup, speedup / limit, speedup / cpu_limit, r["acc"])
        print(f"| {r['eta']} | {r['step_s']:.3f} | {r['wait_s']:.3f} | {r['train_s']:.3f} | "
              f"{r['sync_s']:.3f} | {(r['train_s'] + r['sync_s']) / alone_s:.2f}x | "
              f"{r['wait_s'] / r['step_s']:.0%} | {max(0.0, 1.0 - gen_s / r['step_s']):.0%} | "
              f"{r['staleness_max']:.0f} | {r['dropped']:.0%} | "
              f"{r['len_avg']:.1f} / {r['len_max']:.1f} | "
              f"{r['acc0']:.3f} -> {r['acc']:.3f} | "
              f"{r['wall_s']:.0f} | {speedup:.2f}x | {speedup / limit:.0%} | "
              f"{speedup / cpu_limit:.0%} |")
    print("\nCPU seconds per step, by process (between the records of step 4 and the last)")
    print("| eta | " + " | ".join(ROLES) + " | total |")
    print("|---|" + "---|" * (len(ROLES) + 1))
    for r in rows:
        cells = [f"{r['cpu'].get(role, 0.0):.3f}" for role in ROLES]
        print(f"| {r['eta']} | " + " | ".join(cells) + f" | {sum(r['cpu'].values()):.3f} |")
    return ratios


if __name__ == "__main__":
    main()
