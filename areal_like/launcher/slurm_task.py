"""What one task of the Slurm launcher's `srun` steps runs.

    slurm_task rank <python args...>              a trainer rank: torch.distributed's
                                                   environment from Slurm's, then the recipe
    slurm_task servers K HOST ADDRS_FILE <launch args...>
                                                   K inference servers of the run's config on
                                                   this node, bound to HOST; their addresses
                                                   written to ADDRS_FILE once they serve
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path


def rank_environment(slurm_env: dict[str, str]) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE of this task, from its step's Slurm
    variables (MASTER_ADDR / MASTER_PORT come from the job's driver)."""
    world = int(slurm_env["SLURM_STEP_NUM_TASKS"])
    local_rank = slurm_env["SLURM_LOCALID"]
    if len(slurm_env.get("CUDA_VISIBLE_DEVICES", "").split(",")) == 1 and \
            slurm_env.get("CUDA_VISIBLE_DEVICES"):
        local_rank = "0"  # Slurm bound this task to its one GPU: device 0 of what it sees
    return {"RANK": slurm_env["SLURM_PROCID"], "WORLD_SIZE": str(world),
            "LOCAL_RANK": local_rank,
            "LOCAL_WORLD_SIZE": str(world // int(slurm_env["SLURM_STEP_NUM_NODES"]))}


def _servers(n: int, host: str, addrs_file: str, launch_args: list[str]) -> int:
    from areal_like.launcher.target import resolve_target
    from areal_like.utils.metrics_logger import run_dir
    from engines.fleet.launch import InferenceFleet
    from engines.fleet.serve import run_fleet

    config = resolve_target(launch_args[0], launch_args[1:]).config
    server = dataclasses.replace(config.server, n_servers=n)
    log_dir = run_dir(config.logging) / "slurm" / Path(addrs_file).stem  # beside its .txt
    fleet = InferenceFleet(config.model.path, server, host=host,
                           api_key=config.rollout.client.api_key, log_dir=log_dir)
    # the step lives while one of its servers does (the trainer's client counts the fleet)
    return run_fleet(fleet, 1, addrs_file)


def main(argv: list[str]) -> int:
    if argv[0] == "rank":
        os.environ.update(rank_environment(dict(os.environ)))
        os.execv(sys.executable, [sys.executable, *argv[1:]])
    if argv[0] == "servers":
        return _servers(int(argv[1]), argv[2], argv[3], argv[4:])
    raise SystemExit(f"slurm_task: unknown task {argv[0]!r} (rank | servers)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
