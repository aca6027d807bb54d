"""The main job against Hugging Face TRL's `GRPOTrainer`, one after the other, same machine.

    python benchmarks/vs_trl.py [--seeds 1 2] [--steps 200] [--eval-every 25]
                                [--trl-seeds 1 2] [--skip-ours] [--skip-trl]
                                [--trl-one-thread] [--size 1m|10m] [--max-new-tokens 6]
                                [--worked-fraction 0] [-- OVERRIDES...]

Both start from the main job's SFT warm start (`scripts/warm_start.sh`, built if missing) on
2-digit addition: 16 prompts x 8 samples a step, answers of at most 6 tokens, temperature 1,
AdamW at 1.5e-4 cosine-decayed to a tenth over the run, clip 0.2, no KL, group-normalised
advantages, loss averaged per sequence then over sequences; held-out greedy exact-match on
the same 200 test items at step 0 and every `--eval-every` steps.

- **ours**: `python -m areal_like.launcher.local grpo` as `scripts/main.sh` runs it (extra
  Hydra overrides after `--`); its `metrics.jsonl` is watched as the run writes it, so every
  time here is wall clock seen from outside (launch = the command starts).
- **TRL**: `benchmarks/trl_addition_grpo.py` in TRL's own environment (`.venv-trl`, made by
  `scripts/install_trl.sh` here if missing; never the project's), as its users run it: torch's
  default thread count, one per core this process may use (`OMP_NUM_THREADS` unset).
  `--trl-one-thread` adds TRL pinned to one thread as a labelled extra row (how this benchmark
  ran it before 2026-12-07: not a fair comparison, ours had every core).

Both sides get the same cores: every core this process may use (printed at the start).

Other workloads, both sides alike: `--size 10m` (the 10m tiny model and its own SFT warm
start), and long answers, `--worked-fraction 0.1 --max-new-tokens 64` (a tenth of the items
answered with worked steps, up to ~60 tokens: the SFT warm start, training and held-out items
all made with that fraction).

Columns: launch to exit; start-up (launch to the training loop's first step beginning);
s/step (median step, wall clock, after the first 5; TRL's in-loop evaluations left out);
held-out accuracy at steps 0 / 25 / 50 / last; seconds of training loop until the first
evaluation at or above `--target` (TRL's evaluation time left out: ours runs beside training);
and each against ours (the first seed) as a ratio. What could not be matched is listed in
docs/benchmarks.md ("Against TRL").
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = REPO / ".venv-trl/bin/python"


@dataclass(frozen=True)
class Workload:
    size: str = "1m"
    max_new_tokens: int = 6
    worked_fraction: float = 0.0

    @property
    def warm(self) -> Path:
        """The SFT warm start (the main job's own for the default workload)."""
        if self.size == "1m" and self.worked_fraction == 0.0:
            return REPO / ".cache/models/addition-sft"
        return REPO / f".cache/models/addition-sft-{self.size}-worked{self.worked_fraction:g}"

    def data_overrides(self) -> list[str]:
        return [f"{name}.task_kwargs.worked_fraction={self.worked_fraction}"
                for name in ("train_dataset", "valid_dataset")] if self.worked_fraction else []


@dataclass
class Run:
    name: str
    launch_to_exit: float = 0.0
    startup: float = 0.0
    step_s: list[float] = field(default_factory=list)  # each step's wall clock, in order
    loop_at_step: dict[int, float] = field(default_factory=dict)  # loop seconds at step's end
    accuracy: dict[int, float] = field(default_factory=dict)  # held-out, by step
    breakdown: dict[str, float] = field(default_factory=dict)  # median seconds per step

    def s_per_step(self) -> float:
        steady = self.step_s[5:] or self.step_s
        return statistics.median(steady) if steady else float("nan")

    def to_target(self, target: float) -> Optional[float]:
        for step in sorted(self.accuracy):
            if self.accuracy[step] >= target:
                return self.loop_at_step.get(step, 0.0)
        return None


def ensure_ready(work: Workload) -> None:
    env = dict(os.environ, TINY_SIZE=work.size, SFT_OVERRIDES=" ".join(work.data_overrides()))
    name = "sft_addition" if work.warm.name == "addition-sft" else work.warm.name
    subprocess.run(["bash", "scripts/warm_start.sh", "recipes/conf/sft_addition.yaml",
                    name, str(work.warm.relative_to(REPO))], cwd=REPO, check=True, env=env)


def run_ours(seed: int, steps: int, every: int, overrides: list[str], out: Path,
             work: Workload) -> Run:
    log_dir = out / f"ours_{seed}"
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "grpo", f"model.path={work.warm}",
           f"logging.log_dir={log_dir}", f"seed={seed}", f"total_train_steps={steps}",
           f"evaluation.freq_steps={every}", "logging.tensorboard=false",
           f"gconfig.max_new_tokens={work.max_new_tokens}", *work.data_overrides(), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launched = time.monotonic()
    with open(out / f"ours_{seed}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        seen: dict[int, float] = {}  # training step -> when its record appeared
        records: list[dict[str, Any]] = []
        offset = 0
        while True:
            done = proc.poll() is not None
            for path in log_dir.glob("*/*/metrics.jsonl"):
                with open(path) as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[:chunk.rfind("\n") + 1]
                offset += len(complete)
                now = time.monotonic() - launched
                for line in complete.splitlines():
                    record = json.loads(line)
                    records.append(record)
                    if "timeperf/step" in record:
                        seen.setdefault(int(record["step"]), now)
            if done:
                break
            time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"ours (seed {seed}) exited with {proc.returncode}: "
                         f"{out / f'ours_{seed}.log'}")
    run = Run(f"areal-like, seed {seed}", launch_to_exit=time.monotonic() - launched)
    train = {int(r["step"]): r for r in records if "timeperf/step" in r}
    first = min(train)
    run.startup = seen[first] - float(train[first]["timeperf/step"])
    previous = run.startup
    for step in sorted(seen):
        run.step_s.append(seen[step] - previous)
        previous = seen[step]
        run.loop_at_step[step] = seen[step] - run.startup
    run.loop_at_step[0] = 0.0
    run.accuracy = {int(r["step"]): float(r["eval/accuracy"]) for r in records
                    if "eval/accuracy" in r}
    keys = sorted({k for r in train.values() for k in r
                   if k.startswith(("timeperf/", "weight_sync/"))})
    for key in keys:
        values = [float(r[key]) for s, r in train.items() if s > 5 and key in r]
        if values:
            run.breakdown[key] = statistics.median(values)
    return run


def run_trl(seed: int, steps: int, every: int, out: Path, work: Workload,
            one_thread: bool = False) -> Run:
    name = f"trl_{seed}" + ("_one_thread" if one_thread else "")
    events_path = out / f"{name}.jsonl"
    cmd = [str(TRL_PYTHON), "benchmarks/trl_addition_grpo.py", "--model", str(work.warm),
           "--out", str(events_path), "--seed", str(seed), "--steps", str(steps),
           "--eval-every", str(every), "--max-new-tokens", str(work.max_new_tokens),
           "--worked-fraction", str(work.worked_fraction), "--threads", "1" if one_thread else "0"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    env.pop("OMP_NUM_THREADS", None)  # torch's default: a thread per core, as users run it
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    launched_unix = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    exited_unix = time.time()
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    threads = next(e.get("threads") for e in events if e["event"] == "launched")
    label = f"TRL, seed {seed}, {threads} thread(s)" + (" (extra: pinned)" if one_thread else "")
    run = Run(label, launch_to_exit=exited_unix - launched_unix)
    evals = {e["step"]: e for e in events if e["event"] == "eval"}
    begin = next(e["unix"] for e in events if e["event"] == "train_begin")
    run.startup = begin - launched_unix - evals[0]["eval_s"]
    previous, eval_time = begin, 0.0
    parts: dict[str, list[float]] = {}
    for e in (e for e in events if e["event"] == "step"):
        run.step_s.append(e["unix"] - previous)
        run.loop_at_step[e["step"]] = e["unix"] - begin - eval_time
        previous = e["unix"]
        if e["step"] in evals:  # evaluation inside the loop: not the step's time
            eval_time += evals[e["step"]]["eval_s"]
            previous += evals[e["step"]]["eval_s"]
        if e["step"] > 5:
            for key in ("generate_s", "reward_s", "prepare_s", "step_total_s"):
                parts.setdefault(key, []).append(e[key])
    run.loop_at_step[0] = 0.0
    run.accuracy = {s: e["accuracy"] for s, e in evals.items()}
    run.breakdown = {k: statistics.median(v) for k, v in parts.items()}
    return run


def table(runs: list[Run], steps: int, every: int, target: float) -> str:
    marks = sorted({0, every, 2 * every, steps})
    base = runs[0]
    head = (f"| | launch to exit | start-up | s/step | held-out {' / '.join(map(str, marks))} "
            f"steps | to {target} |")
    lines = [head, "|" + "---|" * 6]
    for run in runs:
        reached = run.to_target(target)
        base_reached = base.to_target(target)

        def ratio(mine: Optional[float], theirs: Optional[float]) -> str:
            return f" ({mine / theirs:.2f}x)" if mine and theirs else ""
        acc = " / ".join(f"{run.accuracy[m]:.3f}" if m in run.accuracy else "-" for m in marks)
        lines.append(
            f"| {run.name} | {run.launch_to_exit:.0f} s"
            f"{ratio(run.launch_to_exit, base.launch_to_exit)}"
            f" | {run.startup:.1f} s{ratio(run.startup, base.startup)}"
            f" | {run.s_per_step():.2f}{ratio(run.s_per_step(), base.s_per_step())}"
            f" | {acc} | "
            + (f"{reached:.0f} s{ratio(reached, base_reached)}" if reached is not None
               else "not reached") + " |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--trl-seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-one-thread", action="store_true",
                        help="also run TRL pinned to one thread (a labelled extra row)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs' files here")
    parser.add_argument("--size", default="1m", choices=["1m", "10m"])
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--worked-fraction", type=float, default=0.0)
    args = parser.parse_args(argv)
    work = Workload(args.size, args.max_new_tokens, args.worked_fraction)
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_trl_"))
    out.mkdir(parents=True, exist_ok=True)
    ensure_ready(work)
    print(f"[vs_trl] cores for each side: {len(os.sched_getaffinity(0))} "
          f"({sorted(os.sched_getaffinity(0))}), runs one after the other", flush=True)
    if not args.skip_trl:
        subprocess.run(["bash", "scripts/install_trl.sh"], cwd=REPO, check=True)
    runs: list[Run] = []
    if not args.skip_ours:
        for seed in args.seeds:
            runs.append(run_ours(seed, args.steps, args.eval_every, overrides, out, work))
            print(f"[vs_trl] {runs[-1].name}: {runs[-1].launch_to_exit:.0f} s", flush=True)
    if not args.skip_trl:
        for seed in args.trl_seeds:
            runs.append(run_trl(seed, args.steps, args.eval_every, out, work))
            print(f"[vs_trl] {runs[-1].name}: {runs[-1].launch_to_exit:.0f} s", flush=True)
        if args.trl_one_thread:
            runs.append(run_trl(args.trl_seeds[0], args.steps, args.eval_every, out, work,
                                one_thread=True))
            print(f"[vs_trl] {runs[-1].name}: {runs[-1].launch_to_exit:.0f} s", flush=True)
    print(table(runs, args.steps, args.eval_every, args.target))
    print("\nmedian seconds per step (after step 5):")
    for run in runs:
        print(f"  {run.name}: " + ", ".join(f"{k}={v:.3f}" for k, v in run.breakdown.items()))
    print(f"\n(runs' files: {out})")


if __name__ == "__main__":
    main()
