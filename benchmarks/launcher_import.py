"""What a launcher process pays to import before it can check a config and start anything.

    python benchmarks/launcher_import.py [--rounds 5]

Each round is a fresh interpreter timing `import areal_like.launcher.local` (now: the
tensordict-heavy names of `areal_like.api` and `areal_like.algorithms` load on first use)
against the same import plus those names (`areal_like.api.trajectory`,
`areal_like.algorithms.actors`, `areal_like.algorithms.filters`: what it imported before
they were lazy), alternating, in the same run. Median seconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOW = "import areal_like.launcher.local"
BEFORE = (NOW + "; import areal_like.api.trajectory, areal_like.algorithms.actors, "
          "areal_like.algorithms.filters")


def _seconds(statement: str) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"before (eager)": [], "now (lazy)": []}
    for _ in range(args.rounds):
        times["before (eager)"].append(_seconds(BEFORE))
        times["now (lazy)"].append(_seconds(NOW))
    base = statistics.median(times["before (eager)"])
    print("| launcher import | median s | min s | vs before |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {min(values):.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
