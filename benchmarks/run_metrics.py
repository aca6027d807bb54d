"""Compare finished runs by the medians of chosen metrics, as ratios to the first run given.

    python benchmarks/run_metrics.py RUN_DIR [RUN_DIR ...] [--keys weight_sync/load_s ...]
                                     [--skip 4]

Each RUN_DIR is a run's folder (`<log_dir>/<experiment>/<trial>`, holding `metrics.jsonl`),
e.g. two main jobs of two trees, run one after the other on the same idle machine:

    (cd TREE_A && bash scripts/main.sh logging.trial_name=a1)
    (cd TREE_B && bash scripts/main.sh logging.trial_name=b1)
    python benchmarks/run_metrics.py TREE_A/runs/grpo_addition/a1 TREE_B/runs/grpo_addition/b1

Steps before `--skip` (the pipeline filling, the first compilations) are left out; the median
of every step after them is printed per key, with its ratio to the first run's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from areal_like.utils.metrics_logger import read_metrics  # noqa: E402

DEFAULT_KEYS = ["weight_sync/export_s", "weight_sync/load_s", "timeperf/weight_sync",
                "timeperf/step"]


def medians(run_dir: Path, keys: list[str], skip: int) -> dict[str, float]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) >= skip]
    found = {}
    for key in keys:
        values = [float(r[key]) for r in records if key in r]
        if values:
            found[key] = statistics.median(values)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--keys", nargs="+", default=DEFAULT_KEYS)
    parser.add_argument("--skip", type=int, default=4)
    args = parser.parse_args()
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            parser.error(f"{run}: no metrics.jsonl (a run's folder is "
                         f"<log_dir>/<experiment>/<trial>)")
    table = [medians(run, args.keys, args.skip) for run in args.runs]
    width = max(len(str(run)) for run in args.runs)
    print(f"{'run':<{width}}  " + "  ".join(f"{k:>24}" for k in args.keys))
    for run, found in zip(args.runs, table, strict=True):
        cells = []
        for key in args.keys:
            if key not in found:
                cells.append(f"{'-':>24}")
                continue
            base = table[0].get(key)
            ratio = f" ({found[key] / base:.2f}x)" if base else ""
            cells.append(f"{found[key]:>14.4f}{ratio:>10}")
        print(f"{str(run):<{width}}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
