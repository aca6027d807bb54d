"""A real MLflow tracking server for a test, and each tracker's record of a run read back
through the tracker's own tools (W&B's `wandb leet inspect`, MLflow's client, Trackio's store)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

# what a tracker adds to each record of its own accord
TRACKER_KEYS = {"step", "_step", "_runtime", "_timestamp", "timestamp", "_wandb"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MLflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store under `root` (its own session, so
    `kill` takes its workers too)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.store = f"sqlite:///{root / 'mlflow.db'}"
        self.log = root / "mlflow_server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MLflowServer:
        self.start()
        return self.wait()

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                 "--port", str(self.port), "--backend-store-uri", self.store,
                 "--default-artifact-root", str(self.root / "artifacts"), "--workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # without its job runner: five huey consumers, each importing MLflow (~20 s
                # of CPU at every start), for server-side jobs the tracker never submits
                env=dict(os.environ, OMP_NUM_THREADS="1",
                         MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))

    def wait(self) -> MLflowServer:
        assert self.proc is not None
        deadline = time.monotonic() + 300  # a busy machine: the event, not the time, counts
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5):
                    return self
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.kill()


def by_step(rows: list[tuple[int, str, float]]) -> dict[tuple[int, str], list[float]]:
    """(step, key) -> every value a tracker holds for it (a duplicate shows as two)."""
    out: dict[tuple[int, str], list[float]] = defaultdict(list)
    for step, key, value in rows:
        out[(step, key)].append(value)
    return dict(out)


def wandb_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline W&B run folder under `run_dir/wandb` (oldest first): its run id, config
    (None where W&B wrote no record) and history rows, as `wandb leet inspect --json` prints
    them."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                              str(folder)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        # a run killed (-9) before W&B wrote its first block left the header alone
        run = next((r["run"] for r in records if r["type"] == "run"), None)
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        runs.append({"id": run["run_id"] if run else folder.name.rsplit("-", 1)[1],
                     "config": run["config"]["update"] if run else None, "history": history})
    return runs


def wandb_rows(runs: list[dict[str, Any]]) -> list[tuple[int, str, float]]:
    return [(int(item["step"]), key, float(value)) for run in runs for item in run["history"]
            for key, value in item.items() if key not in TRACKER_KEYS]


def mlflow_runs(uri: str, experiment: str) -> list[dict[str, Any]]:
    """Every run of `experiment` with its parameters and every point of every metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    runs = []
    for run in client.search_runs([found.experiment_id]):
        rows = [(m.step, key, m.value) for key in run.data.metrics
                for m in client.get_metric_history(run.info.run_id, key)]
        runs.append({"id": run.info.run_id, "name": run.info.run_name,
                     "status": run.info.status, "params": run.data.params, "rows": rows})
    return runs


def trackio_runs(trackio_dir: Path, project: str) -> list[dict[str, Any]]:
    """Every run of `project` in a local Trackio store, read by Trackio's own storage class (in
    a process of its own: trackio reads TRACKIO_DIR once, at import)."""
    code = (
        "import json, sys\n"
        "from trackio.sqlite_storage import SQLiteStorage as S\n"
        "p = sys.argv[1]\n"
        "print(json.dumps([{'name': n, 'config': S.get_run_config(p, run=n),"
        " 'logs': S.get_logs(p, run=n)} for n in S.get_runs(p)], default=str))\n")
    out = subprocess.run([sys.executable, "-c", code, project], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TRACKIO_DIR=str(trackio_dir)))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def trackio_rows(run: dict[str, Any]) -> list[tuple[int, str, float]]:
    return [(int(log["step"]), key, float(value)) for log in run["logs"]
            for key, value in log.items() if key not in TRACKER_KEYS]
