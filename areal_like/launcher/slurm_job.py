"""The Slurm launcher inside its allocation: one `srun` step of inference servers per server
node, then one step of trainer ranks, each task logging to a file of its own under
`<run dir>/slurm/`.

Placement: `launcher.slurm.server_nodes` first nodes run the servers (`server.n_servers`
spread over them), the others the trainer ranks (`launcher.n_trainer_procs`, evenly); with
`server_nodes=0` both share every node. A trainer that fails, or a fleet that goes down,
requeues the job (`scontrol requeue`) while `SLURM_RESTART_COUNT` < `launcher.slurm
.max_requeues`: the job starts again and the run resumes from its last checkpoint."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_like.launcher.slurm_commands import hostnames, node_address, slurm, step_ids
from areal_like.launcher.target import LaunchError, TrainTarget
from areal_like.utils.metrics_logger import run_dir

STOP_GRACE_S = 60.0  # how long a step gets to stop after SIGTERM before SIGKILL


@dataclasses.dataclass
class Placement:
    server_nodes: list[str]
    trainer_nodes: list[str]
    servers_per_node: list[int]  # server.n_servers spread over server_nodes
    ranks_per_node: int


def trainer_node_count(config: Any, n_nodes: int, needs_fleet: bool) -> int:
    """How many of the job's `n_nodes` run trainer ranks: the nodes after the server nodes,
    or, sharing them, as many as split `launcher.n_trainer_procs` evenly."""
    server_nodes, n_ranks = config.launcher.slurm.server_nodes, config.launcher.n_trainer_procs
    if not needs_fleet or server_nodes == 0:
        return math.gcd(n_ranks, n_nodes)
    if server_nodes >= n_nodes:
        raise LaunchError(f"launcher.slurm.server_nodes={server_nodes} leaves none of the "
                          f"job's {n_nodes} node(s) to the trainer")
    if n_ranks % (n_nodes - server_nodes):
        raise LaunchError(f"launcher.n_trainer_procs={n_ranks} does not split evenly over "
                          f"the {n_nodes - server_nodes} trainer node(s)")
    return n_nodes - server_nodes


def place(config: Any, nodes: list[str], needs_fleet: bool) -> Placement:
    n_trainer = trainer_node_count(config, len(nodes), needs_fleet)
    shared = config.launcher.slurm.server_nodes == 0
    server_nodes = (nodes if shared else nodes[:-n_trainer]) if needs_fleet else []
    trainer_nodes = nodes[:n_trainer] if shared or not needs_fleet else nodes[-n_trainer:]
    n = config.server.n_servers
    spread = [n // len(server_nodes) + (i < n % len(server_nodes))
              for i in range(len(server_nodes))]
    return Placement([node for node, k in zip(server_nodes, spread, strict=True) if k],
                     trainer_nodes, [k for k in spread if k],
                     config.launcher.n_trainer_procs // n_trainer)


def _srun(nodes: list[str], tasks_per_node: int, output: Path, name: str,
          gpus_per_task: int = 0) -> list[str]:
    # --overlap: the steps share the allocation's CPUs (a server step and the ranks on one node)
    gpus = [f"--gpus-per-task={gpus_per_task}"] if gpus_per_task else []
    return ["srun", "--overlap", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tasks_per_node}", *gpus,
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}",
            f"--output={output}", "--open-mode=append",  # a requeued job's logs follow on
            f"--job-name={name}", "--kill-on-bad-exit=1", "--export=ALL"]


def _stop(job_id: str, steps: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to each named step's tasks (`scancel --signal=TERM JOB.STEP`: srun itself
    answers a SIGTERM with SIGKILL), then SIGKILL through srun after STOP_GRACE_S."""
    running = {name: step for name, step in steps.items() if step.poll() is None}
    if not running:
        return
    ids = step_ids(job_id)
    targets = [i for name in running for i in ids.get(name, [])]
    if targets:
        slurm("scancel", "--signal=TERM", *targets, check=False)
    deadline = time.monotonic() + STOP_GRACE_S
    for step in running.values():
        try:
            step.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait(timeout=30)


def _start_servers(launch_args: list[str], placement: Placement, logs: Path,
                   gpus_per_server: int, steps: dict[str, subprocess.Popen]) -> list[Path]:
    """One step per server node (named `servers-<node>`, in `steps` once started):
    `slurm_task servers` there reads the run's config itself."""
    files = []
    hosts = [node_address(node) for node in placement.server_nodes]
    for node, host, k in zip(placement.server_nodes, hosts, placement.servers_per_node,
                             strict=True):
        addrs = logs / f"servers-{node}.txt"
        addrs.unlink(missing_ok=True)
        cmd = [*_srun([node], 1, logs / f"servers-{node}.log", f"servers-{node}",
                      gpus_per_server * k),
               sys.executable, "-m", "areal_like.launcher.slurm_task", "servers", str(k), host,
               str(addrs), *launch_args]
        steps[f"servers-{node}"] = subprocess.Popen(cmd, start_new_session=True)
        files.append(addrs)
    return files


def _wait_for_servers(steps: list[subprocess.Popen], files: list[Path], timeout: float,
                      logs: Path) -> list[str]:
    """Every server step's addresses, once all have written them; a step that ends first,
    or a wait past `timeout`, fails the launch naming the step's log."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        for step, f in zip(steps, files, strict=True):
            if step.poll() is not None and not f.exists():
                log = f.with_suffix(".log")
                raise LaunchError(f"the server step for {f.stem} ended ({step.returncode}) "
                                  f"before its servers were up; its log: {log}\n"
                                  + _tail(log))
        if time.monotonic() > deadline:
            raise LaunchError(f"servers not up within {timeout:g} s (server.startup_timeout); "
                              f"their logs: {logs}/servers-*.log")
        time.sleep(0.5)
    return [a for f in files for a in f.read_text().split()]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except FileNotFoundError:
        return ""


def drive(target: TrainTarget, launch_args: list[str]) -> int:
    """Run the job in the current allocation (`launch_args`: the launcher's own arguments,
    `<recipe or script> [--config FILE] [key=value ...]`); the trainer step's exit code."""
    config = target.config
    if getattr(config, "teacher", None) is not None and not config.teacher.server_addrs:
        raise LaunchError("the Slurm launcher does not start a teacher fleet: start one "
                          "(areal-like serve) and set teacher.server_addrs")
    job_id = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    nodes = hostnames(os.environ["SLURM_JOB_NODELIST"])
    needs_fleet = target.needs_fleet and not config.rollout.server_addrs
    placement = place(config, nodes, needs_fleet)
    logs = run_dir(config.logging) / "slurm"
    logs.mkdir(parents=True, exist_ok=True)
    servers_on = dict(zip(placement.server_nodes, placement.servers_per_node, strict=True))
    print(f"[slurm] job {job_id} (restart {restarts}) on {nodes}: servers {servers_on or '-'}, "
          f"trainer ranks on {placement.trainer_nodes} x{placement.ranks_per_node}; "
          f"logs in {logs}", flush=True)
    steps: dict[str, subprocess.Popen] = {}  # step name -> its srun
    extra: list[str] = []
    try:
        if needs_fleet:
            gpus = config.server.gpus_per_server if config.launcher.slurm.gpus_per_node else 0
            files = _start_servers(launch_args, placement, logs, gpus, steps)
            addresses = _wait_for_servers(list(steps.values()), files,
                                          config.server.startup_timeout, logs)
            print(f"[slurm] servers ready: {addresses}", flush=True)
            extra.append(f"rollout.server_addrs=[{','.join(addresses)}]")
        master = node_address(placement.trainer_nodes[0])
        env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(
            config.launcher.master_port or 20000 + int(job_id) % 20000),
            OMP_NUM_THREADS=str(config.launcher.threads_per_trainer),
            TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **config.launcher.trainer_env)
        if master.startswith("127."):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every "node" is this machine
        cmd = [*_srun(placement.trainer_nodes, placement.ranks_per_node,
                      logs / "trainer-%t.log", "trainer",
                      1 if config.launcher.slurm.gpus_per_node else 0),
               sys.executable, "-m", "areal_like.launcher.slurm_task", "rank",
               *target.entry, *target.args(extra)]
        print(f"[slurm] $ {' '.join(cmd)}", flush=True)
        trainer = steps["trainer"] = subprocess.Popen(cmd, env=env, start_new_session=True)
        while trainer.poll() is None:
            time.sleep(1.0)
            down = [name for name, step in steps.items() if step.poll() is not None]
            if down:  # its servers are past their restarts: the fleet is down
                print(f"[slurm] step {down[0]} ended ({steps[down[0]].returncode}); stopping "
                      f"the trainer", flush=True)
                _stop(job_id, {"trainer": trainer})
                break
        code = trainer.returncode if trainer.returncode is not None else 1
    finally:
        _stop(job_id, steps)
    if code != 0:
        print(f"[slurm] trainer ended with code {code} (its ranks' logs: "
              f"{logs}/trainer-*.log)", flush=True)
        # a batch job only (Slurm sets ENVIRONMENT=BATCH there): salloc's cannot be requeued
        batch = os.environ.get("ENVIRONMENT") == "BATCH"
        if restarts < config.launcher.slurm.max_requeues and batch:
            print(f"[slurm] requeue {restarts + 1}/{config.launcher.slurm.max_requeues}: the "
                  f"run resumes from its last checkpoint", flush=True)
            slurm("scontrol", "requeue", job_id)
    return code
