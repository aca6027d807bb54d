"""On-policy distillation against GRPO alone, from the same SFT start, two seeds each.

    python -m benchmarks.distill_vs_grpo [--steps 60] [--eval-every 10] [--seeds 1 2]
                                         [--start MODEL_DIR] [--levels 0.5 0.9]
                                         [--distill-args KEY=VALUE ...] [--grpo-args ...]

Needs the main job's files: the SFT warm start `.cache/models/addition-sft` (student and GRPO's
start) and a teacher in `.cache/models/addition-teacher` (docs/algorithms.md). Each run goes
through the local launcher (real fleets, real trainer); held-out accuracy of version k is put
at the wall time at which the trainer produced version k (the run's `time`, from the
trainer's start), so the table compares equal wall time as well as equal steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run(recipe: str, seed: int, steps: int, eval_every: int, log_dir: Path,
        reuse: bool = False, start: Path | None = None, extra: list[str] | None = None) -> Path:
    name = f"{recipe}_seed{seed}"
    metrics = log_dir / name / "trial0" / "metrics.jsonl"
    if reuse and metrics.exists() and steps in curve(metrics):
        print(f"reusing {metrics}", flush=True)
        return metrics
    cmd = [sys.executable, "-m", "areal_like.launcher.local", recipe, f"seed={seed}",
           f"total_train_steps={steps}", f"evaluation.freq_steps={eval_every}",
           f"logging.log_dir={log_dir}", f"logging.experiment_name={name}",
           "logging.trial_name=trial0", "logging.plot=false"]
    if start is not None:
        cmd.append(f"model.path={start}")
    cmd += extra or []
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return metrics


def curve(metrics: Path) -> dict[int, tuple[float, float]]:
    """version -> (wall time at which the trainer produced it, held-out accuracy)."""
    times: dict[int, float] = {}
    acc: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "eval/accuracy" in rec:
            acc[rec["step"]] = rec["eval/accuracy"]
        elif "time" in rec:
            times.setdefault(rec["step"], rec["time"])
    return {k: (times.get(k, 0.0), a) for k, a in sorted(acc.items())}


def at_time(points: dict[int, tuple[float, float]], t: float) -> float:
    """Accuracy of the newest version produced by wall time t."""
    best = [a for (when, a) in points.values() if when <= t]
    return best[-1] if best else float("nan")


def mean_over_time(points: dict[int, tuple[float, float]], start: float, end: float) -> float:
    """Mean held-out accuracy over wall time [start, end] (the newest version's at each
    moment; version 0's until the first later one): the area under the curve, over its
    length."""
    steps = sorted(points.values())
    area = 0.0
    for (when, acc), (nxt, _) in zip(steps, steps[1:] + [(end, 0.0)], strict=True):
        lo = max(0.0 if when == steps[0][0] else when, start)
        area += acc * max(min(nxt, end) - lo, 0.0)
    return area / (end - start)


def time_to(points: dict[int, tuple[float, float]], level: float) -> str:
    """Wall time (s) and version at which held-out accuracy first reached `level`."""
    for k, (when, acc) in points.items():
        if acc >= level:
            return f"{when:.0f} s (v{k})"
    return "not reached"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--log-dir", type=Path, default=Path("runs/distill_vs_grpo"))
    parser.add_argument("--reuse", action="store_true", help="keep finished runs in --log-dir")
    parser.add_argument("--start", type=Path, default=None,
                        help="both runs' start (default: the recipes' model.path, the SFT start)")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.9, 0.95, 0.98])
    parser.add_argument("--distill-args", nargs="*", default=[],
                        help="overrides for the distill runs only (e.g. gconfig.n_samples=4)")
    parser.add_argument("--grpo-args", nargs="*", default=[],
                        help="overrides for the GRPO runs only")
    args = parser.parse_args()
    curves = {(recipe, seed): curve(run(recipe, seed, args.steps, args.eval_every, args.log_dir,
                                        args.reuse, args.start,
                                        args.distill_args if recipe == "distill"
                                        else args.grpo_args))
              for seed in args.seeds for recipe in ("grpo", "distill")}
    print("\n| seed | version | GRPO: accuracy (s) | distill: accuracy (s) |")
    print("|---|---|---|---|")
    for seed in args.seeds:
        grpo, distill = curves[("grpo", seed)], curves[("distill", seed)]
        for k in sorted(set(grpo) | set(distill)):
            g, d = grpo.get(k, (float("nan"),) * 2), distill.get(k, (float("nan"),) * 2)
            print(f"| {seed} | {k} | {g[1]:.3f} ({g[0]:.0f}) | {d[1]:.3f} ({d[0]:.0f}) |")
    print("\n| seed | wall time (s) | GRPO accuracy | distill accuracy | distill - GRPO |")
    print("|---|---|---|---|---|")
    for seed in args.seeds:
        grpo, distill = curves[("grpo", seed)], curves[("distill", seed)]
        end = min(max(t for t, _ in grpo.values()), max(t for t, _ in distill.values()))
        for frac in (0.25, 0.5, 1.0):
            t = end * frac
            g, d = at_time(grpo, t), at_time(distill, t)
            print(f"| {seed} | {t:.0f} | {g:.3f} | {d:.3f} | {d - g:+.3f} |")
    print("\n| seed | over (s) | GRPO mean accuracy | distill mean accuracy | distill - GRPO |")
    print("|---|---|---|---|---|")
    for seed in args.seeds:
        grpo, distill = curves[("grpo", seed)], curves[("distill", seed)]
        end = min(max(t for t, _ in grpo.values()), max(t for t, _ in distill.values()))
        for start in (0.0, end / 2):
            g, d = mean_over_time(grpo, start, end), mean_over_time(distill, start, end)
            print(f"| {seed} | {start:.0f}-{end:.0f} | {g:.3f} | {d:.3f} | {d - g:+.3f} |")
    print("\n| seed | reached | GRPO | distill |\n|---|---|---|---|")
    for seed in args.seeds:
        for level in args.levels:
            print(f"| {seed} | {level} | {time_to(curves[('grpo', seed)], level)} | "
                  f"{time_to(curves[('distill', seed)], level)} |")


if __name__ == "__main__":
    main()
