"""Slurm launcher: the run as a Slurm job, its servers and trainer ranks on the job's nodes.

    python -m areal_like.launcher.slurm <recipe> [--config FILE] [key=value ...]
    python -m areal_like.launcher.slurm path/to/train.py --config FILE [key=value ...]

Outside an allocation it writes `<run dir>/slurm/job.sh` and submits it with `sbatch`
(`launcher.slurm`: nodes, partition, account, time limit, GPUs, more `#SBATCH` lines), then
follows the job: its state changes and the trainer's rank-0 log on the console, until it ends
(its exit code is this command's; `launcher.slurm.wait=false` returns once submitted). Ctrl-C
cancels the job. Inside an allocation (`salloc`, or the submitted script itself) it runs the job
there with `srun`: slurm_job.py. Every task logs to `<run dir>/slurm/`; `scancel JOB` stops
every process; a failed trainer requeues the job up to `launcher.slurm.max_requeues` times,
resuming from its last checkpoint.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from areal_like.api.config_loader import ConfigError
from areal_like.launcher.local import CONSOLE, follow_log
from areal_like.launcher.slurm_commands import FINAL_STATES, exit_code, job_state, slurm
from areal_like.launcher.slurm_job import drive, place
from areal_like.launcher.target import (
    LaunchError,
    TrainTarget,
    check_model_path,
    launcher_main,
    resolve_target,
)
from areal_like.utils.metrics_logger import run_dir

POLL_S = 2.0  # how often the submitter asks slurmctld for the job's state
CONTROLLER_PATIENCE_S = 300.0  # how long it goes on asking while slurmctld does not answer


def batch_script(target: TrainTarget, launch_args: list[str], logs: Path) -> str:
    """The `sbatch` script: the allocation asked for, then this launcher again inside it."""
    config = target.config
    slurm_config = config.launcher.slurm
    # one task per rank on a trainer node: srun steps may not start more tasks than that
    placement = place(config, [f"node{i}" for i in range(slurm_config.nodes)],
                      target.needs_fleet and not config.rollout.server_addrs)
    options = [f"--job-name=areal-like-{config.logging.experiment_name}",
               f"--nodes={slurm_config.nodes}", f"--ntasks-per-node={placement.ranks_per_node}",
               f"--cpus-per-task={slurm_config.cpus_per_task}",
               f"--output={logs}/job-%j.out", "--open-mode=append",
               "--requeue" if slurm_config.max_requeues else "--no-requeue"]
    for flag, value in (("partition", slurm_config.partition),
                        ("account", slurm_config.account), ("time", slurm_config.time_limit),
                        ("gpus-per-node", slurm_config.gpus_per_node or "")):
        if value:
            options.append(f"--{flag}={value}")
    options += slurm_config.sbatch_args
    python_path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in options),
        "# written by areal_like.launcher.slurm: the same launcher, now inside the allocation",
        f"cd {shlex.quote(os.getcwd())}",
        f"export PYTHONPATH={shlex.quote(python_path)}",
        "exec " + shlex.join([sys.executable, "-m", "areal_like.launcher.slurm", *launch_args]),
        ""])


def _follow_job(job_id: str, logs: Path) -> int:
    """Print the job's state as it changes and stream rank 0's log until the job ends."""
    stop = threading.Event()
    follow_log("trainer", logs / "trainer-0.log", stop)
    last, unanswered_since = "", None
    try:
        while True:
            try:
                state = job_state(job_id)
                unanswered_since = None
            except LaunchError as e:  # slurmctld busy or restarting: ask again, for a while
                unanswered_since = unanswered_since or time.monotonic()
                if time.monotonic() - unanswered_since > CONTROLLER_PATIENCE_S:
                    raise LaunchError(f"{e} (for {CONTROLLER_PATIENCE_S:g} s; job {job_id} "
                                      f"may still run: scancel {job_id})") from None
                time.sleep(POLL_S)
                continue
            if state is None:
                raise LaunchError(f"job {job_id} is no longer known to slurmctld; its output: "
                                  f"{logs}/job-{job_id}.out")
            now = f"{state.get('JobState')} (restarts {state.get('Restarts', '0')})"
            if now != last:
                CONSOLE.line(f"[slurm] job {job_id}: {now} on {state.get('NodeList')}")
                last = now
            if state.get("JobState") in FINAL_STATES:
                return exit_code(state)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        slurm("scancel", job_id)
        CONSOLE.line(f"[slurm] cancelled job {job_id}")
        raise
    finally:
        stop.set()
        CONSOLE.close()


def launch(target_name: str, argv: list[str]) -> int:
    launch_args = [target_name, *argv]
    target = resolve_target(target_name, argv)  # fails fast on a typo
    check_model_path(target.config)
    config = target.config
    if config.launcher.slurm.max_requeues and config.checkpoint.recover != "auto":
        raise ConfigError("launcher.slurm.max_requeues > 0 needs checkpoint.recover=auto (a "
                          "requeued job resumes from its last checkpoint)")
    if os.environ.get("SLURM_JOB_ID"):
        return drive(target, launch_args)
    logs = run_dir(config.logging) / "slurm"
    logs.mkdir(parents=True, exist_ok=True)
    script = logs / "job.sh"
    script.write_text(batch_script(target, launch_args, logs))
    job_id = slurm("sbatch", "--parsable", str(script)).strip().split(";")[0]
    CONSOLE.line(f"[slurm] submitted job {job_id} ({script}); its logs: {logs}; "
                 f"`scancel {job_id}` stops it")
    if not config.launcher.slurm.wait:
        return 0
    code = _follow_job(job_id, logs)
    print(f"[slurm] job {job_id} ended with code {code}; its output: {logs}/job-{job_id}.out",
          file=sys.stderr if code else sys.stdout, flush=True)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    return launcher_main(launch, __doc__ or "", argv, "the Slurm job")


if __name__ == "__main__":
    sys.exit(main())
