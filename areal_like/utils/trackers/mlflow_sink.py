"""MLflow: one MLflow run per run (in the experiment `logging.mlflow.experiment`), continued by
a resumed run (same run id); the run's config as its parameters."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

from areal_like.api.config import LoggingConfig
from areal_like.utils.trackers.base import install_hint

# MLflow's limits: names of these characters only, 1000 metrics / 100 params per call, and a
# parameter's value at most 6000 characters
_REFUSED = re.compile(r"[^A-Za-z0-9_\-. :/]")
_METRICS_PER_CALL = 1000
_PARAMS_PER_CALL = 100
_PARAM_VALUE_MAX = 6000


def mlflow_key(key: str) -> str:
    """`eval/pass@4` -> `eval/pass_at_4`; any other character MLflow refuses -> `_`."""
    return _REFUSED.sub("_", key.replace("@", "_at_"))


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(f"{prefix}.{key}" if prefix else str(key), inner)
    else:
        yield mlflow_key(prefix), str(value)[:_PARAM_VALUE_MAX]


def wait_for_tracking_server(uri: str, timeout_s: float) -> None:
    """Until the server's `/health` answers; a server that does not within `timeout_s` fails
    with the last reason."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
                reason = f"/health answered {reply.status}"
        except (urllib.error.URLError, OSError) as e:
            reason = str(getattr(e, "reason", e))
        if time.monotonic() > deadline:
            raise ConnectionError(f"the tracking server at {uri} did not answer within "
                                  f"{timeout_s:g} s (logging.mlflow.start_timeout_s): {reason}")
        time.sleep(0.5)


class MLflowSink:
    name = "mlflow"

    def __init__(self, config: LoggingConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        self.config = config.mlflow
        self.uri = self.config.tracking_uri or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.experiment = self.config.experiment or config.experiment_name
        self.trial_name = config.trial_name
        self.run_config = run_config
        self._client: Any = None
        self._run_id = ""

    def start(self, saved: dict[str, Any]) -> None:
        # a dead server is then reported within a minute, not after MLflow's default 7 retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(install_hint(self.name)) from e
        if self.uri.startswith(("http://", "https://")):
            wait_for_tracking_server(self.uri, self.config.start_timeout_s)
        self._client = MlflowClient(self.uri)
        if saved.get("run_id"):
            self._run_id = saved["run_id"]
            self._client.update_run(self._run_id, status="RUNNING")
            return
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = (found.experiment_id if found is not None
                         else self._client.create_experiment(self.experiment))
        run = self._client.create_run(experiment_id, run_name=self.trial_name)
        self._run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in _flatten("", self.run_config)]
        for i in range(0, len(params), _PARAMS_PER_CALL):
            self._client.log_batch(self._run_id, params=params[i:i + _PARAMS_PER_CALL])

    def resume_state(self) -> dict[str, Any]:
        return {"run_id": self._run_id, "tracking_uri": self.uri}

    def tracker_key(self, key: str) -> str:
        return mlflow_key(key)

    def received(self) -> Optional[dict[str, int]]:
        """The last step of every metric the MLflow run holds."""
        keys = self._client.get_run(self._run_id).data.metrics
        return {key: max(m.step for m in self._client.get_metric_history(self._run_id, key))
                for key in keys}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), _METRICS_PER_CALL):
            self._client.log_batch(self._run_id, metrics=batch[i:i + _METRICS_PER_CALL])

    def finish(self) -> None:
        self._client.set_terminated(self._run_id)
