"""`kill -9` of the trainer (or `kill` of the whole launch) mid-run, then
`checkpoint.recover=auto` (real SGLang + torchrun), through the local launcher attached to the
session's fleet, reset to the session weights at version 0 before each run (the trainer is
what dies here; servers dying are test_faults'):

- eta = 0: a killed-then-recovered run ends with exactly the weights and per-step metrics of an
  uninterrupted run with its seed (the two are separate processes from the start, so this
  also checks that one seed gives one run); it logs to the three experiment trackers as well
  (W&B offline, an MLflow server, Trackio's local store), and each holds every metric of every
  step once, in one tracker run continued by the resume;
- eta = 2, the launch stopped by SIGTERM: no trajectory is trained twice, the buffered
  trajectories restored are exactly the checkpointed ones (by episode id) and are trained
  after the resume, the staleness bound holds across the resume, the metrics log has every
  step once and the fleet got the last version.

The kill waits for an observable event (a metrics step after the first checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from sglang_helpers import (
    assert_same_records,
    attach_args,
    processes_running_module,
    reset_fleet,
)
from tracker_helpers import (
    MLflowServer,
    by_step,
    mlflow_runs,
    trackio_rows,
    trackio_runs,
    wandb_rows,
    wandb_runs,
)

from areal_like.utils.metrics_logger import read_metrics
from areal_like.utils.trackers.mlflow_sink import mlflow_key

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
STEPS = 8
# Wall-clock quantities differ between any two runs, and so do gauges of work under way: the
# episodes of the next batch (prefetched while training) and the reward calls they made so far.
VOLATILE = ("time", "timeperf/", "perf/", "rollout/episode_latency", "weight_sync/",
            "rollout/running", "rollout/queued", "rollout/buffered", "rollout/capacity",
            "reward/calls",
            # the fleet client's requests since its process started (not resumed state)
            "fleet/batched_requests", "fleet/merged_requests")

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


def _args(fleet, model_dir: Path, log_dir: Path, eta: int, *extra: str) -> list[str]:
    # eta = 0 writes its checkpoints beside the next steps (checkpoint.async_save): a killed
    # run resumes from the last one committed, bit-identical all the same
    return [sys.executable, "-m", "areal_like.launcher.local", "grpo", *attach_args(fleet),
            f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"total_train_steps={STEPS}", f"rollout.staleness.max_head_offpolicyness={eta}",
            "gconfig.n_samples=4", "gconfig.max_new_tokens=4", "rollout.staleness.consumer_batch_size=4",
            "train_dataset.batch_size=4", "train_dataset.size=400", "valid_dataset.size=16",
            "evaluation.n_prompts=16", "evaluation.freq_steps=100", "checkpoint.freq_steps=2",
            "checkpoint.recover=auto", f"checkpoint.async_save={eta == 0}",
            "logging.tensorboard=false", "logging.plot=false", *extra]


def _run(fleet, model_dir: Path, log_dir: Path, eta: int, *extra: str) -> str:
    proc = subprocess.run(_args(fleet, model_dir, log_dir, eta, *extra), cwd=REPO, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    if name == "metrics.jsonl":  # evaluations finish after their step: merged into it
        return read_metrics(run_dir / name)
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line]


def _kill_trainer(proc: subprocess.Popen) -> None:
    pids = processes_running_module(proc.pid, "recipes.grpo")
    assert pids, "trainer process not found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # kill -9, no cleanup runs


def _terminate_the_launch(proc: subprocess.Popen) -> None:
    # SIGTERM to the launcher's whole session, as `kill` sends it (a shell's background job
    # ignores SIGINT)
    os.killpg(proc.pid, signal.SIGTERM)


def _kill_trainer_after(fleet, model_dir: Path, log_dir: Path, eta: int, step: int,
                        stop: Callable[[subprocess.Popen], None] = _kill_trainer,
                        extra: tuple[str, ...] = ()) -> None:
    """Start a run, `stop` it (SIGKILL of its trainer) once metrics of `step` (after a
    checkpoint) exist."""
    run_dir = log_dir / "grpo_addition" / "trial0"
    proc = subprocess.Popen(_args(fleet, model_dir, log_dir, eta, *extra), cwd=REPO, env=ENV,
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, f"step {step} not logged within 900 s"
            path = run_dir / "metrics.jsonl"
            if (run_dir / "checkpoints" / "latest").exists() and path.exists() and any(
                    r["step"] >= step for r in _records(run_dir)):
                break
            time.sleep(0.05)
        stop(proc)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode != 0, out[-3000:]  # interrupted, not finished


def _weights_sha(run_dir: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted((run_dir / "weights" / f"v{STEPS}").glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_eta0_a_killed_run_resumes_bit_identical_to_an_uninterrupted_one(fresh_fleet,
                                                                         tiny_model_dir,
                                                                         tmp_path):
    a, c = tmp_path / "a", tmp_path / "c"
    mlflow = MLflowServer(tmp_path / "mlflow")
    mlflow.start()  # beside the first run
    try:
        _run(fresh_fleet, tiny_model_dir, a, eta=0)
        trackers = ("logging.wandb.enabled=true", "logging.mlflow.enabled=true",
                    f"logging.mlflow.tracking_uri={mlflow.wait().uri}",
                    "logging.trackio.enabled=true", f"logging.trackio.dir={tmp_path / 'trackio'}")
        run = lambda root: root / "grpo_addition" / "trial0"  # noqa: E731
        reset_fleet(fresh_fleet, tiny_model_dir)  # as new for the second run
        _kill_trainer_after(fresh_fleet, tiny_model_dir, c, eta=0,
                            step=random.randint(3, STEPS - 2), extra=trackers)
        out = _run(fresh_fleet, tiny_model_dir, c, 0, *trackers)
        assert "recovered from" in out
        assert [r["step"] for r in _records(run(c))] == list(range(STEPS + 1))  # each step once
        assert_same_records(_stable(_records(run(c))), _stable(_records(run(a))))
        assert _weights_sha(run(c)) == _weights_sha(run(a))
        _assert_trackers_hold_the_run(_records(run(c)), run(c), mlflow.uri, tmp_path / "trackio")
    finally:
        mlflow.kill()


def _assert_trackers_hold_the_run(records: list[dict], run_dir: Path, mlflow_uri: str,
                                  trackio_dir: Path) -> None:
    """Each tracker: every (step, key) of metrics.jsonl exactly once, in one tracker run, with
    its value there (the replayed steps' wall-clock values are the killed run's: a tracker
    keeps what it got first)."""
    expected = {(r["step"], k): v for r in records for k, v in r.items()
                if k not in ("step", "time")}
    wandb = wandb_runs(run_dir)
    mlflow = mlflow_runs(mlflow_uri, "grpo_addition")
    trackio = trackio_runs(trackio_dir, "grpo_addition")
    assert len({r["id"] for r in wandb}) == 1 and len(wandb) == 2  # killed, then resumed
    assert len(mlflow) == 1 and mlflow[0]["status"] == "FINISHED"
    assert [r["name"] for r in trackio] == ["trial0"]
    for name, rows, key in (("wandb", wandb_rows(wandb), str), ("mlflow", mlflow[0]["rows"],
                            mlflow_key), ("trackio", trackio_rows(trackio[0]), str)):
        held = by_step(rows)
        twice = {k: v for k, v in held.items() if len(v) > 1}
        assert not twice, f"{name} holds a step twice: {sorted(twice)[:5]}"
        assert set(held) == {(s, key(k)) for s, k in expected}, name
        for (step, k), value in expected.items():
            if not k.startswith(VOLATILE) and not math.isnan(value):
                assert held[(step, key(k))] == [value], (name, step, k)


def test_eta2_resume_loses_and_repeats_no_trajectory(fresh_fleet, tiny_model_dir, tmp_path):
    """Here the whole launch is stopped (SIGTERM to its session, as `kill` sends it), not
    only its trainer."""
    run_dir = tmp_path / "grpo_addition" / "trial0"
    _kill_trainer_after(fresh_fleet, tiny_model_dir, tmp_path, eta=2,
                        step=random.randint(3, STEPS - 2), stop=_terminate_the_launch)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = torch.load(latest / "run_state.pt", weights_only=False)["executor"]
    checkpointed = [f"{b['data_id']}@{b['episode_seed']}" for b in saved["buffered"]]

    out = _run(fresh_fleet, tiny_model_dir, tmp_path, eta=2)
    assert f"recovered from {latest}" in out
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # each step once
    assert (run_dir / "weights" / f"v{STEPS}").is_dir()  # the fleet got the last version
    assert max(r.get("rollout/staleness_max", 0) for r in records) <= 2
    episodes = _records(run_dir, "episodes.jsonl")
    restored = [e["restored"] for e in episodes if "restored" in e]
    assert restored == [checkpointed]  # exactly the buffered trajectories checkpointed
    trained = [i for e in episodes if "trained" in e for i in e["trained"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert len([e for e in episodes if "trained" in e]) == STEPS
    resume_step = next(e["step"] for e in episodes if "restored" in e)
    after = {i for e in episodes if e.get("step", 0) > resume_step for i in e.get("trained", [])}
    assert set(checkpointed) <= after  # none of them lost
