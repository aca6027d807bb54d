"""Slurm's own commands (`sbatch`, `scontrol`, `scancel`), each with a timeout and its error
named; nothing here talks to Slurm any other way."""

from __future__ import annotations

import shutil
import subprocess
from typing import Optional

from areal_like.launcher.target import LaunchError

COMMAND_TIMEOUT_S = 60.0  # slurmctld answers in milliseconds; a busy one in seconds
# the states a job ends in (`scontrol show job`); REQUEUED / PENDING / RUNNING go on
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


def slurm(*args: str, check: bool = True) -> str:
    """Run a Slurm command; its stdout. A missing command or a failure raises `LaunchError`
    with Slurm's own message."""
    if shutil.which(args[0]) is None:
        raise LaunchError(f"{args[0]} not found: the Slurm launcher needs Slurm's client "
                          f"commands (Debian: apt-get install slurm-client)")
    try:
        out = subprocess.run(list(args), capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(args)}` did not answer within {COMMAND_TIMEOUT_S:g} s "
                          f"(is slurmctld up?)") from None
    if check and out.returncode != 0:
        raise LaunchError(f"`{' '.join(args)}` failed ({out.returncode}): "
                          f"{(out.stderr or out.stdout).strip()}")
    return out.stdout


def hostnames(nodelist: str) -> list[str]:
    """`n[1-2]` -> ["n1", "n2"] (Slurm's own expansion)."""
    return slurm("scontrol", "show", "hostnames", nodelist).split()


def _fields(line: str) -> dict[str, str]:
    """`Key=value Key2=value2 ...` (one `scontrol show -o` record)."""
    out = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (its NodeAddr)."""
    return _fields(slurm("scontrol", "show", "node", "-o", node)).get("NodeAddr", node)


def job_state(job_id: str) -> Optional[dict[str, str]]:
    """The job's record (JobState, ExitCode, Restarts, NodeList, ...), or None once slurmctld
    has forgotten it; slurmctld not answering raises (`LaunchError`)."""
    if shutil.which("scontrol") is None:
        slurm("scontrol")  # names what is missing
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`scontrol show job {job_id}` did not answer within "
                          f"{COMMAND_TIMEOUT_S:g} s (is slurmctld up?)") from None
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None
        raise LaunchError(f"`scontrol show job {job_id}` failed: {out.stderr.strip()}")
    return _fields(out.stdout.splitlines()[0]) if out.stdout.strip() else None


def exit_code(state: dict[str, str]) -> int:
    """A finished job's exit code (`ExitCode=code:signal`; a signal as 128 + it); a job that
    did not complete (cancelled, timed out, a node failed) is 1 even where Slurm says 0:0."""
    code, _, signal = state.get("ExitCode", "1:0").partition(":")
    found = 128 + int(signal) if int(signal or 0) else int(code)
    return found if found or state.get("JobState") == "COMPLETED" else 1


def step_ids(job_id: str) -> dict[str, list[str]]:
    """Step name -> the ids (`JOB.STEP`) of the job's running steps of that name."""
    out: dict[str, list[str]] = {}
    for line in slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j", check=False).splitlines():
        step, _, name = line.strip().partition(" ")
        if step:
            out.setdefault(name.strip(), []).append(step)
    return out
