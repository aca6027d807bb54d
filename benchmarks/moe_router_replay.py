"""Router replay (R3) on the mixture of experts: the main job's GRPO (η = 2) from the MoE SFT
warm start, with and without replay, per seed, one run after the other.

    python benchmarks/moe_router_replay.py [--seeds 1 2] [--steps 200] [-- OVERRIDES...]

Both arms return the server's routing (rollout.return_routed_experts), so both measure how
often the trainer's own top-k picks the experts the server used (`moe_route_agreement`,
the routes of the trained batch, before its update); only the replay arm routes by them.
Printed per run and as a ratio (replay / no replay, same seed): the train/inference gap
(`actor/gap/*`, averaged over the run's steps: all tokens, and the tokens 0 and 1 versions
old), the route agreement, and held-out greedy accuracy at the first, middle and last
evaluation. The warm start is made by `scripts/moe_warm_start.sh` if missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARM = REPO / ".cache/models/addition-sft-moe"
GAP_KEYS = {"gap |d|": "actor/gap/abs_log_diff/avg", "gap k3": "actor/gap/k3/avg",
            "lag0 |d|": "actor/gap/lag0/abs_log_diff/avg",
            "lag1 |d|": "actor/gap/lag1/abs_log_diff/avg",
            "route agreement": "moe_route_agreement"}


def run(name: str, seed: int, replay: bool, steps: int, overrides: list[str]) -> dict[str, Any]:
    out = REPO / "runs" / "moe_router_replay"
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "grpo",
           f"model.path={WARM}", f"seed={seed}", f"total_train_steps={steps}",
           "rollout.return_routed_experts=true", f"actor.moe.router_replay={str(replay).lower()}",
           f"logging.log_dir={out}", f"logging.experiment_name={name}", *overrides]
    start = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True)
    rows = [json.loads(line) for line in
            (out / name / "trial0" / "metrics.jsonl").read_text().splitlines()]
    result: dict[str, Any] = {"run": name, "wall_s": time.monotonic() - start}
    for label, key in GAP_KEYS.items():
        values = [r[key] for r in rows if key in r]
        result[label] = statistics.fmean(values) if values else float("nan")
    result["accuracy"] = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both arms")
    args = parser.parse_args()
    if not (WARM / "config.json").is_file():
        subprocess.run(["bash", "scripts/moe_warm_start.sh"], cwd=REPO, check=True)
    results = []
    for seed in args.seeds:
        for replay in (False, True):
            name = f"seed{seed}_{'replay' if replay else 'own_routing'}"
            results.append(run(name, seed, replay, args.steps, args.overrides))
    print_table(results)


def print_table(results: list[dict[str, Any]]) -> None:
    steps = sorted(results[0]["accuracy"])
    shown = [steps[0], steps[len(steps) // 2], steps[-1]]
    head = ["run", *GAP_KEYS, *[f"held-out @{s}" for s in shown], "wall s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for i, r in enumerate(results):
        cells = [r["run"], *[f"{r[k]:.3g}" for k in GAP_KEYS],
                 *[f"{r['accuracy'].get(s, float('nan')):.3f}" for s in shown],
                 f"{r['wall_s']:.0f}"]
        print("| " + " | ".join(cells) + " |")
        if i % 2 == 1:  # replay against its seed's own-routing run
            base = results[i - 1]
            ratios = [f"{r[k] / base[k]:.2f}x" if base[k] else "-" for k in GAP_KEYS]
            print("| " + " | ".join(["replay / own", *ratios, "", "", "", ""]) + " |")


if __name__ == "__main__":
    main()
