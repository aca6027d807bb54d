"""Run as `torchrun --nproc_per_node=2 main_rank_worker.py --mode M ...` (tests/test_main_rank.py).

Rank 0 works in a phase of its own (real rollouts from a real SGLang server, rewards in real
worker processes) while rank 1 waits in collectives bounded by `--collective-timeout`.

- `slow`: the rollout takes several collective timeouts; every rank must get the batch.
- `unguarded`: rank 0 is busy past the timeout without `run_on_main` (the control: rank 1
  must fail, which shows the timeout is real).
- `server_dies`: rank 0 rolls out until the server is killed by the test; every rank must
  end with the same `MainRankError`.

Each rank writes `rank<r>.json` with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import reward_fns
import torch
import torch.distributed as dist
from config_helpers import rollout_config
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from areal_like.api.config import RewardConfig
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.rollout.controller import RolloutController
from areal_like.runtime.main_rank import MainRankError, run_on_main
from areal_like.utils.distributed import ensure_process_group
from engines.fleet.client import RemoteSGLangEngine
from workflows import RLVRWorkflow

GCONFIG = GenerationHyperparameters(n_samples=2, max_new_tokens=4, temperature=1.0)


def items(n: int, seconds: float) -> list[dict]:
    return [{"id": f"m{i}", "messages": [{"role": "user", "content": f"What is {i} + 1?"}],
             "answer": str(i + 1), "seconds": str(seconds)} for i in range(n)]


def start_together(out: Path, bound_s: float = 600.0) -> None:
    """Join the process group only when both ranks are ready: the group's short timeout also
    bounds its set-up, and on a busy machine one rank may finish importing seconds later."""
    rank = int(os.environ["RANK"])
    (out / f"ready{rank}").touch()
    deadline = time.monotonic() + bound_s
    while not all((out / f"ready{r}").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other rank did not start within {bound_s} s")
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["slow", "unguarded", "server_dies"], required=True)
    ap.add_argument("--collective-timeout", type=float, required=True)
    ap.add_argument("--addr", default="")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    timeout = args.collective_timeout
    rank = int(os.environ["RANK"])
    engine = rewards = None
    if rank == 0 and args.mode != "unguarded":
        # set up before the group exists: the other rank's collective timeout bounds only
        # what follows, however long a busy machine takes to start a controller
        rollout = rollout_config(
            server_addrs=[args.addr], api_key=args.api_key, seed=1, request_retries=2,
            retry_backoff=0.1, request_timeout=60, server_down_timeout=5.0,
            health_check_interval=0.5)  # the only server dies: stop 5 s later
        engine = RolloutController(rollout, RemoteSGLangEngine(rollout))
        engine.initialize()
        rewards = RewardExecutor(RewardConfig(max_workers=1, timeout=120))
        workflow = RLVRWorkflow(reward_fns.sleeps_briefly, GCONFIG,
                                AutoTokenizer.from_pretrained(args.model), rewards)
    start_together(Path(args.out))
    ensure_process_group("gloo", torch.device("cpu"), timeout)
    assert dist.get_rank() == rank
    report: dict = {"rank": rank}
    out = Path(args.out) / f"rank{rank}.json"

    if args.mode == "unguarded":
        try:
            if rank == 0:
                time.sleep(3 * timeout)  # busy beyond the timeout, with no heartbeat
            dist.barrier()
            report["ok"] = True
        except Exception as e:  # noqa: BLE001 - what the test inspects
            report["error"] = f"{type(e).__name__}: {e}"
        out.write_text(json.dumps(report))
        return

    try:
        if args.mode == "slow":
            # 2 items x 2 samples, each reward takes one collective timeout, in one worker
            data = items(2, timeout)
            start = time.monotonic()
            batch = run_on_main(lambda: engine.rollout_batch(data, workflow),
                                "waiting for rollouts", timeout)
            report["phase_s"] = time.monotonic() - start
            holder = [None if batch is None else batch["input_ids"].shape[0]]
            dist.broadcast_object_list(holder, src=0)
            report["rows"] = holder[0]
            dist.barrier()
        else:
            def until_the_server_dies() -> None:
                for i in range(1000):
                    engine.rollout_batch(items(2, 0.0), workflow)
                    if i == 0:
                        (Path(args.out) / "first_batch_done").touch()  # the test kills now

            try:
                run_on_main(until_the_server_dies, "waiting for rollouts", timeout)
            except MainRankError as e:
                report["error"] = f"{type(e).__name__}: {e}"
                report["error_at"] = time.time()
                out.write_text(json.dumps(report))
                raise
    finally:
        if engine is not None:
            engine.destroy()
        if rewards is not None:
            rewards.shutdown()
    out.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
