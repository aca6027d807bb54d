"""What a reward timeout costs: the time to start a worker that replaces the one stopped.

    python benchmarks/reward_worker_restart.py [--rounds 3] [--busy 2]

Each round is a fresh process that imports what a recipe imports (`recipes.grpo`: torch,
transformers, the trainer), as the rollout controller does, and runs a one-worker reward pool:
a call, a call that hangs past `reward.timeout`, then a call whose time is the replacement's
start (from the timeout's verdict to its result). `reward.worker_start=spawn` (the baseline:
every worker imports the program again) against `forkserver` (workers forked from one process
that imported it once). `--busy N` runs N CPU-bound processes beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import reward_fns  # noqa: E402

import recipes.grpo  # noqa: E402, F401  (what the rollout controller's program imports)
from areal_like.api.config import RewardConfig  # noqa: E402
from areal_like.rewards.reward_executor import RewardExecutor  # noqa: E402

METHODS = ("spawn", "forkserver")
TIMEOUT_S = 2.0


async def _calls(executor: RewardExecutor) -> float:
    await executor(reward_fns.worker_pid, "q", "a")
    try:
        await executor(reward_fns.worker_pid, "q", "a", hang=True)
        raise AssertionError("the hanging call returned")
    except Exception as e:  # the timeout's verdict: a RewardFailure
        assert getattr(e, "kind", None) == "timeout", e
    start = time.monotonic()
    await executor(reward_fns.worker_pid, "q", "a")
    return time.monotonic() - start


def one_round(method: str) -> dict[str, float]:
    executor = RewardExecutor(RewardConfig(max_workers=1, timeout=TIMEOUT_S,
                                           worker_start=method))
    start = time.monotonic()
    executor.check(reward_fns.worker_pid, {})
    first = time.monotonic() - start
    replacement = asyncio.run(_calls(executor))
    executor.shutdown()
    return {"first_worker_s": first, "replacement_s": replacement}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside it")
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_round(args.one)))
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        results: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                out = subprocess.run([sys.executable, __file__, "--one", method], check=True,
                                     capture_output=True, text=True, cwd=REPO).stdout
                results[method].append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in busy:
            p.kill()
    base = statistics.median(r["replacement_s"] for r in results["spawn"])
    print(f"reward timeout {TIMEOUT_S} s, one worker, {args.busy} busy processes, "
          f"median of {args.rounds} rounds (seconds)\n")
    print("| worker_start | first worker | replacement | rounds | vs spawn |")
    print("|---|---|---|---|---|")
    for method in METHODS:
        firsts = [r["first_worker_s"] for r in results[method]]
        repl = [r["replacement_s"] for r in results[method]]
        print(f"| {method} | {statistics.median(firsts):.2f} | {statistics.median(repl):.3f} | "
              f"{', '.join(f'{x:.3f}' for x in repl)} | "
              f"{statistics.median(repl) / base:.3f}× |")


if __name__ == "__main__":
    main()
