"""GRPO on the verifier, GRPO on a trained reward model, and DPO alone, at equal wall time.

    python -m benchmarks.preference_stages [--grpo-steps 200] [--rm-steps 400]
                                           [--dpo-steps 200] [--eval-every 25]
                                           [--marks 30 60 ... 370] [--log-dir DIR]

All three start from the main job's SFT warm start (`.cache/models/addition-sft`,
`scripts/main.sh` makes it) on 2-digit addition and are judged by the same held-out
exact match (200 test problems, greedy):

- **GRPO, verifier**: the main job (`areal-like run grpo`).
- **RM + GRPO**: `areal-like run rm` (pairs: the right sum against a wrong answer), its
  `final/` served by `python -m areal_like.rewards.rm_server --model`, then the main job with
  `reward.remote_rm_url` and `evaluation.verifier=task` (the RM trains, the verifier judges).
- **DPO**: `areal-like run dpo` on the same kind of pairs (its held-out accuracy is the
  teacher-forced greedy exact match, which equals greedy decoding's).

Wall time is seen from outside: each command's metrics.jsonl is watched as it is written, an
evaluation counted at the moment its line appears, from the launch of the method's first
stage (the RM's training and server start count against RM + GRPO); the points are kept in
`<log dir>/points.json`. At the end every final
model is evaluated by `areal-like eval --config recipes/conf/grpo_addition.yaml` (SGLang,
greedy, the task's verifier), the same measure for all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARM = REPO / ".cache/models/addition-sft"
ENV = dict(os.environ, OMP_NUM_THREADS="1")


class Watched:
    """A command whose metrics.jsonl is read as it grows: (wall s since `t0`, eval accuracy)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.points = t0, []  # type: ignore[var-annotated]

    def run(self, cmd: list[str], metrics: Path, key: str = "eval/accuracy") -> None:
        print("$", " ".join(cmd), flush=True)
        done = threading.Event()
        seen: set[int] = set()

        def watch() -> None:
            while not done.is_set():
                if metrics.is_file():
                    for line in metrics.read_text().splitlines():
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError:  # a line still being written
                            break
                        if key in record and record["step"] not in seen:
                            seen.add(record["step"])
                            self.points.append((time.monotonic() - self.t0, record[key]))
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            subprocess.run(cmd, cwd=REPO, env=ENV, check=True, stdout=subprocess.DEVNULL)
        finally:
            time.sleep(1.0)  # the last lines
            done.set()
            watcher.join()

    def at(self, t: float) -> float:
        """The newest evaluation's accuracy by wall time t (nan before the first)."""
        before = [a for when, a in self.points if when <= t]
        return before[-1] if before else float("nan")


def launch(recipe: str, name: str, log_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "areal_like.launcher.local", recipe, f"model.path={WARM}",
            f"logging.log_dir={log_dir}", f"logging.experiment_name={name}",
            "logging.trial_name=trial0", "logging.tensorboard=false", *extra]


def serve_reward_model(folder: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "areal_like.rewards.rm_server", "--port", "0",
                             "--model", str(folder)], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server's first line: its address, once it serves
    if not line:
        raise RuntimeError(f"rm_server exited with {proc.wait()} before serving {folder}")
    return proc, json.loads(line)["url"]


def final_accuracy(folder: Path) -> float:
    out = folder.parent / "final.eval.json"
    subprocess.run([sys.executable, "-m", "areal_like.cli", "eval", str(folder), "--config",
                    "recipes/conf/grpo_addition.yaml"], cwd=REPO, env=ENV, check=True,
                   stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["eval/accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--rm-steps", type=int, default=400)
    parser.add_argument("--dpo-steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--marks", type=float, nargs="+",
                        default=[30, 60, 90, 140, 200, 280, 370])
    parser.add_argument("--log-dir", type=Path, default=REPO / ".cache/bench/preference_stages")
    args = parser.parse_args()
    if not (WARM / "config.json").is_file():
        sys.exit(f"{WARM} is missing: run scripts/main.sh once (it makes the SFT warm start)")
    log, every = args.log_dir, f"evaluation.freq_steps={args.eval_every}"
    runs: dict[str, tuple[Watched, float, Path]] = {}

    grpo = Watched(time.monotonic())
    grpo.run(launch("grpo", "grpo_verifier", log, f"total_train_steps={args.grpo_steps}", every),
             log / "grpo_verifier/trial0/metrics.jsonl")
    runs["GRPO, verifier"] = (grpo, time.monotonic() - grpo.t0, log / "grpo_verifier/trial0")

    pipeline = Watched(time.monotonic())
    pipeline.run(launch("rm", "rm", log, f"total_train_steps={args.rm_steps}"),
                 log / "rm/trial0/metrics.jsonl", key="eval/no_such_key")
    rm_done = time.monotonic() - pipeline.t0
    server, url = serve_reward_model(log / "rm/trial0/final")
    try:
        pipeline.run(launch("grpo", "grpo_rm", log, f"total_train_steps={args.grpo_steps}", every,
                            f"reward.remote_rm_url={url}", "evaluation.verifier=task"),
                     log / "grpo_rm/trial0/metrics.jsonl")
    finally:
        server.kill()
        server.wait()
    runs["RM + GRPO"] = (pipeline, time.monotonic() - pipeline.t0, log / "grpo_rm/trial0")

    dpo = Watched(time.monotonic())
    dpo.run(launch("dpo", "dpo", log, f"total_train_steps={args.dpo_steps}", every),
            log / "dpo/trial0/metrics.jsonl")
    runs["DPO"] = (dpo, time.monotonic() - dpo.t0, log / "dpo/trial0")

    points = {name: {"wall_s": wall, "evaluations": watched.points}
              for name, (watched, wall, _) in runs.items()}
    (log / "points.json").write_text(json.dumps(points, indent=1) + "\n")
    marks = " | ".join(f"at {m:.0f} s" for m in args.marks)
    print(f"\nRM training + server start: {rm_done:.0f} s of RM + GRPO's time\n")
    print(f"| method | launch to exit | {marks} | final (areal-like eval) |")
    print("|---|---|" + "---|" * len(args.marks) + "---|")
    for name, (watched, wall, run_dir) in runs.items():
        cells = " | ".join(f"{watched.at(m):.3f}" for m in args.marks)
        final = final_accuracy(run_dir / "final")
        print(f"| {name} | {wall:.0f} s | {cells} | {final:.3f} |", flush=True)
    print("\n(start: the SFT warm start's held-out accuracy, logged at step 0 by each run)")


if __name__ == "__main__":
    main()
