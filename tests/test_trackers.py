"""The experiment trackers as metric sinks, each real: W&B in offline mode (read back with
`wandb leet inspect`), an `mlflow server` on 127.0.0.1 with a SQLite store (read back with
MLflow's client), Trackio's local store (read back with its own storage class).

The run's metrics logger is driven here directly (what a whole training run sends them, and its
kill -9 and resume, are in tests/test_recover.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from tracker_helpers import (
    MLflowServer,
    by_step,
    free_port,
    mlflow_runs,
    trackio_rows,
    trackio_runs,
    wandb_rows,
    wandb_runs,
)

from areal_like.api.config import LoggingConfig
from areal_like.api.tracker_config import MLflowConfig, TrackioConfig, WandbConfig
from areal_like.utils.metrics_logger import MetricsLogger, read_metrics
from areal_like.utils.trackers import TrackerStartError
from areal_like.utils.trackers.mlflow_sink import mlflow_key

REPO = Path(__file__).resolve().parents[1]
RUN_CONFIG = {"seed": 3, "actor": {"optimizer": {"lr": 1e-5}}}


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One Trackio store for the module: trackio reads TRACKIO_DIR once, at its import."""
    where = tmp_path_factory.mktemp("trackio")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRACKIO_DIR", str(where))
        yield where


def _logging(root: Path, experiment: str, trackio_dir: Path, uri: str, **enabled: bool
             ) -> LoggingConfig:
    return LoggingConfig(
        log_dir=str(root), experiment_name=experiment, console=False, tensorboard=False,
        plot=False, wandb=WandbConfig(enabled=enabled.get("wandb", True)),
        mlflow=(MLflowConfig(enabled=True, tracking_uri=uri, start_timeout_s=5)
                if enabled.get("mlflow", True) else MLflowConfig()),
        trackio=(TrackioConfig(enabled=True, dir=str(trackio_dir))
                 if enabled.get("trackio", True) else TrackioConfig()))


def _step_metrics(step: int, attempt: int) -> dict[str, float]:
    # an attempt's values differ, so which one a tracker kept is seen
    return {"loss": 1 / (step + 1) + attempt, "eval/pass@4": step / 10 + attempt}


def _run(logger: MetricsLogger, steps: range, attempt: int,
         sent: dict[tuple[int, str], float]) -> None:
    """Log `steps`, each step's evaluation two steps late (a record of its own, as
    evaluations finish while training goes on); note the first value of each (step, key)."""
    for step in steps:
        records = [(step, _step_metrics(step, attempt))]
        if step >= 2:
            records.append((step - 2, {"eval/accuracy": step / 100 + attempt}))
        for at, metrics in records:
            logger.log(at, metrics)
            for key, value in metrics.items():
                sent.setdefault((at, key), value)
    logger.close()


@pytest.mark.e2e  # real wandb/MLflow/Trackio clients start: ~25 s
def test_every_metric_goes_to_each_tracker_once_per_step_and_a_resume_continues_its_run(
        tmp_path, trackio_dir):
    """Steps 0-5, a "checkpoint" after step 3, then a resumed run logging 4-9 again with other
    values: metrics.jsonl keeps the resumed run's records (its rule); each tracker holds every
    (step, key) once, the values it got first, in one tracker run carrying the config."""
    with MLflowServer(tmp_path / "mlflow") as server:
        config = _logging(tmp_path / "runs", "exp_resume", trackio_dir, server.uri)
        first: dict[tuple[int, str], float] = {}
        _run(MetricsLogger(config, run_config=RUN_CONFIG), range(0, 6), 0, first)
        _run(MetricsLogger(config, fresh=False, keep_through=3, run_config=RUN_CONFIG),
             range(4, 10), 1, first)
        mlflow = mlflow_runs(server.uri, "exp_resume")
        jsonl = read_metrics(tmp_path / "runs" / "exp_resume" / "trial0" / "metrics.jsonl")
        # a new run of the same trial (no checkpoint: fresh) is a new tracker run, not this one
        wandb_before = wandb_runs(tmp_path / "runs" / "exp_resume" / "trial0")
        trackio_before = trackio_runs(trackio_dir, "exp_resume")
        _run(MetricsLogger(config, run_config=RUN_CONFIG), range(0, 1), 2, {})
        assert len(mlflow_runs(server.uri, "exp_resume")) == 2
    run_dir = tmp_path / "runs" / "exp_resume" / "trial0"
    assert [r["step"] for r in jsonl] == list(range(10))
    assert jsonl[4]["loss"] == 1 / 5 + 1  # the resumed run's
    expected = {k: [v] for k, v in first.items()}
    assert len(expected) == 10 * 2 + 8  # every step's two keys, steps 0-7 evaluated

    wandb = wandb_before
    assert len(wandb) == 2 and wandb[0]["id"] == wandb[1]["id"]  # one run, continued
    assert wandb[1]["config"]["actor"]["optimizer"]["lr"] == 1e-5
    assert by_step(wandb_rows(wandb)) == expected

    assert len(mlflow) == 1 and mlflow[0]["status"] == "FINISHED"
    assert mlflow[0]["params"]["actor.optimizer.lr"] == "1e-05"
    assert by_step(mlflow[0]["rows"]) == {(s, mlflow_key(k)): v for (s, k), v in expected.items()}

    trackio = trackio_before
    assert [r["name"] for r in trackio] == ["trial0"]
    assert trackio[0]["config"]["seed"] == 3
    assert by_step(trackio_rows(trackio[0])) == expected

    assert sorted(r["name"] for r in trackio_runs(trackio_dir, "exp_resume")) == [
        "trial0", "trial0-2"]
    ids = {r["id"] for r in wandb_runs(run_dir)}
    assert len(ids) == 2


def _sent_through(run_dir: Path, tracker: str, key: str) -> int:
    state = json.loads((run_dir / "trackers.json").read_text())
    return state.get(tracker, {}).get("sent", {}).get(key, -1)


@pytest.mark.e2e  # real wandb/MLflow/Trackio clients start: ~25 s
def test_a_tracker_dying_mid_run_is_reported_once_and_the_others_keep_every_step(
        tmp_path, trackio_dir, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # its failure now, not in 14 s
    with MLflowServer(tmp_path / "mlflow") as server:
        config = _logging(tmp_path / "runs", "exp_dies", trackio_dir, server.uri, wandb=False)
        run_dir = tmp_path / "runs" / "exp_dies" / "trial0"
        logger = MetricsLogger(config)
        for step in range(3):
            logger.log(step, _step_metrics(step, 0))
        deadline = time.monotonic() + 300
        while _sent_through(run_dir, "mlflow", "loss") < 2:  # the server has steps 0-2
            assert time.monotonic() < deadline, "MLflow never took step 2"
            time.sleep(0.05)
        server.kill()
        for step in range(3, 8):
            logger.log(step, _step_metrics(step, 0))
        logger.close()
    reports = [line for line in capsys.readouterr().err.splitlines() if "[logging]" in line]
    assert len(reports) == 1, reports
    assert reports[0].startswith("[logging] mlflow failed at step 3: ")
    assert "training goes on" in reports[0]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(8))
    trackio = trackio_runs(trackio_dir, "exp_dies")
    assert sorted({s for s, _, _ in trackio_rows(trackio[0])}) == list(range(8))
    kept = mlflow_runs(server.store, "exp_dies")  # the store itself: its server is gone
    assert sorted({s for s, _, _ in kept[0]["rows"]}) == [0, 1, 2]


def test_a_tracker_that_cannot_start_fails_the_run_at_start_with_the_reason(
        tmp_path, trackio_dir):
    dead = f"http://127.0.0.1:{free_port()}"
    config = _logging(tmp_path / "runs", "exp_dead", trackio_dir, dead, wandb=False,
                      trackio=False)
    with pytest.raises(TrackerStartError, match=rf"logging.mlflow: could not start: .*{dead}"):
        MetricsLogger(config)
    # through the launcher: refused by its preflight, before any server starts
    out = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "grpo",
         "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={dead}",
         "logging.mlflow.start_timeout_s=1", f"logging.log_dir={tmp_path / 'launch'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = (out.stdout + out.stderr).strip().splitlines()[-1]
    assert "logging.mlflow.tracking_uri" in last and dead in last, last
    assert not (tmp_path / "launch").exists()
