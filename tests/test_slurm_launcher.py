"""The Slurm launcher against a real Slurm: Debian's slurm-wlm, slurmctld and two slurmd ("n1",
"n2", both on 127.0.0.1) with munge, started by scripts/slurm_test_cluster.sh.

- `sbatch`: the servers' step on n1, the trainer's rank on n2 (read from the processes' own
  environment), rendezvous from Slurm's; the trainer killed (-9) after a checkpoint fails its
  step, the job requeues itself and the run resumes, every step once; each task's log apart.
- inside an allocation (`salloc`): the launcher runs the job with `srun` there; `scancel`
  stops every process of the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.utils.metrics_logger import read_metrics
from areal_like.utils.start_costs import record_start

REPO = Path(__file__).resolve().parents[1]
# servers of its own only (started by Slurm): beside the serial lane
pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.beside_serial]
STEPS = 6


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root (slurmd, munged)")
    where = tmp_path_factory.mktemp("slurm")
    script = REPO / "scripts" / "slurm_test_cluster.sh"
    started = time.monotonic()
    out = subprocess.run(["bash", str(script), "start", str(where)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record_start("slurm cluster", time.monotonic() - started, "munged, slurmctld, 2 slurmd")
    env = dict(os.environ, SLURM_CONF=str(where / "slurm.conf"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    yield env
    subprocess.run(["bash", str(script), "stop", str(where)], timeout=120)


def _args(model_dir: Path, log_dir: Path, *extra: str) -> list[str]:
    return ["grpo", f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"total_train_steps={STEPS}", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
            "rollout.staleness.consumer_batch_size=2", "train_dataset.batch_size=2",
            "train_dataset.size=100", "valid_dataset.size=4", "evaluation.n_prompts=4",
            "checkpoint.freq_steps=2", "checkpoint.recover=auto", "logging.tensorboard=false",
            "launcher.slurm.nodes=2", *extra]


def _job_processes(job_id: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every process of the job (Slurm gives each SLURM_JOB_ID)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            raw = (entry / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        if env.get("SLURM_JOB_ID") == job_id:
            found[int(entry.name)] = env
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_for(what: str, ready, timeout: float = 900,  # noqa: ANN001
              launch: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        if launch is not None and launch.poll() is not None:
            raise AssertionError(f"{what}: the launcher ended first ({launch.returncode}):\n"
                                 + launch.stdout.read()[-4000:])
        time.sleep(0.2)
    return found


def _metrics_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path)), default=-1) if path.exists() else -1


def test_sbatch_places_servers_and_ranks_then_a_killed_trainer_requeues_and_resumes(
        slurm_cluster, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "grpo_addition" / "trial0"
    launch = subprocess.Popen(
        [sys.executable, "-m", "areal_like.launcher.slurm",
         *_args(tiny_model_dir, tmp_path, "launcher.slurm.server_nodes=1",
                "launcher.slurm.max_requeues=1")],
        cwd=REPO, env=slurm_cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    first, job_id = "", None
    try:
        while job_id is None:  # the launcher's first lines, up to the submission's
            line = launch.stdout.readline()
            assert line, f"the launcher ended before submitting:\n{first}"
            first += line
            found = re.search(r"submitted job (\d+)", line)
            job_id = found.group(1) if found else None
        _wait_for("a step after the first checkpoint", lambda: (
            (run_dir / "checkpoints" / "latest").exists() and _metrics_step(run_dir) >= 3),
            launch=launch)
        processes = _job_processes(job_id)
        trainer = [p for p, env in processes.items() if "RANK" in env
                   and "recipes.grpo" in _cmdline(p) and "slurm_task" not in _cmdline(p)]
        servers = [env for p, env in processes.items() if "sglang" in _cmdline(p)]
        assert len(trainer) == 1, {p: _cmdline(p) for p in processes}
        rank_env = processes[trainer[0]]
        assert (rank_env["SLURMD_NODENAME"], rank_env["RANK"], rank_env["WORLD_SIZE"],
                rank_env["MASTER_ADDR"]) == ("n2", "0", "1", "127.0.0.1")
        assert servers and {env["SLURMD_NODENAME"] for env in servers} == {"n1"}
        os.kill(trainer[0], signal.SIGKILL)
        out, _ = launch.communicate(timeout=900)
    finally:
        if job_id is not None:  # whatever happened, no job left for the next test
            subprocess.run(["scancel", job_id], env=slurm_cluster, timeout=60)
        if launch.poll() is None:
            launch.kill()
    out = first + out
    assert launch.returncode == 0, out[-4000:]
    assert "RUNNING (restarts 1)" in out and "COMPLETED" in out, out[-3000:]
    logs = run_dir / "slurm"
    job_out = (logs / f"job-{job_id}.out").read_text()
    assert "requeue 1/1" in job_out and "restart 1" in job_out, job_out[-3000:]
    assert "recovered from" in (logs / "trainer-0.log").read_text()
    assert "servers ready" in (logs / "servers-n1.log").read_text()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(
        range(STEPS + 1))  # each step once across the requeue
    _wait_for("every process of the job gone", lambda: not _job_processes(job_id), timeout=120)


def test_inside_an_allocation_it_runs_with_srun_and_scancel_stops_every_process(
        slurm_cluster, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "grpo_addition" / "trial0"
    launch = subprocess.Popen(
        ["salloc", "--nodes=2", sys.executable, "-m", "areal_like.launcher.slurm",
         *_args(tiny_model_dir, tmp_path, f"total_train_steps={STEPS * 50}")],
        cwd=REPO, env=slurm_cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        _wait_for("the first step", lambda: _metrics_step(run_dir) >= 1, launch=launch)
        job = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_cluster,
                             capture_output=True, text=True, timeout=60).stdout.split()
        assert len(job) == 1, job
        processes = _job_processes(job[0])
        assert any("recipes.grpo" in _cmdline(p) for p in processes)
        assert any("sglang" in _cmdline(p) for p in processes)
        subprocess.run(["scancel", job[0]], env=slurm_cluster, check=True, timeout=60)
        out, _ = launch.communicate(timeout=300)
        assert launch.returncode != 0
        _wait_for("every process of the job gone", lambda: not _job_processes(job[0]),
                  timeout=120)
    finally:
        if launch.poll() is None:
            subprocess.run(["scancel", "--user=root"], env=slurm_cluster, timeout=60)
            os.killpg(launch.pid, signal.SIGKILL)
    assert (run_dir / "slurm" / "trainer-0.log").exists()
