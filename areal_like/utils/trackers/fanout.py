"""Every enabled tracker, fed from a thread of its own, under the rules metrics.jsonl follows.

- Each tracker key goes to a tracker at most once per step: a resumed run continues the same
  tracker run (its id kept in `<run dir>/trackers.json`), first sends it what metrics.jsonl
  kept and the tracker lacks (records it had not written when the run was killed), and skips
  what the tracker already holds (read back from the tracker where it can tell, else from that
  file); steps logged again after a resume keep the value the tracker got first.
- A tracker that cannot start fails the run at its start, with the reason.
- A tracker that fails mid-run is reported once and takes nothing more; training goes on
  (metrics.jsonl, tensorboard and the other trackers keep every step).
"""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from areal_like.api.config import LoggingConfig
from areal_like.utils.atomic_file import write_atomic
from areal_like.utils.trackers.base import TrackerSink, install_hint

STATE_FILE = "trackers.json"


class TrackerStartError(RuntimeError):
    """A tracker enabled under `logging` could not start: the run stops before its first step."""


def build_sinks(config: LoggingConfig, run_dir: Path,
                run_config: dict[str, Any]) -> list[TrackerSink]:
    sinks: list[TrackerSink] = []
    if config.wandb.enabled:
        from areal_like.utils.trackers.wandb_sink import WandbSink

        sinks.append(WandbSink(config, run_dir, run_config))
    if config.mlflow.enabled:
        from areal_like.utils.trackers.mlflow_sink import MLflowSink

        sinks.append(MLflowSink(config, run_dir, run_config))
    if config.trackio.enabled:
        from areal_like.utils.trackers.trackio_sink import TrackioSink

        sinks.append(TrackioSink(config, run_dir, run_config))
    return sinks


def check_trackers(config: LoggingConfig) -> None:
    """Before any process starts: every enabled tracker installed, and an MLflow tracking
    server answering (a ValueError naming the key otherwise)."""
    for name in ("wandb", "mlflow", "trackio"):
        if getattr(config, name).enabled and importlib.util.find_spec(name) is None:
            raise ValueError(install_hint(name))
    uri = config.mlflow.tracking_uri
    if config.mlflow.enabled and uri.startswith(("http://", "https://")):
        from areal_like.utils.trackers.mlflow_sink import wait_for_tracking_server

        try:
            wait_for_tracking_server(uri, config.mlflow.start_timeout_s)
        except ConnectionError as e:
            raise ValueError(f"logging.mlflow.tracking_uri: {e}") from None


class _StateFile:
    """`trackers.json`: per tracker, what finds its run again and the last step of each key
    it was sent. Written whole (atomically) by the trackers' threads, under one lock."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self._lock = threading.Lock()
        if fresh:
            path.unlink(missing_ok=True)
        try:
            self.state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        except json.JSONDecodeError as e:
            raise TrackerStartError(
                f"{path}: not JSON ({e}); delete it to start new tracker runs") from e

    def saved(self, name: str) -> dict[str, Any]:
        return dict(self.state.get(name, {}))

    def update(self, name: str, **values: Any) -> None:
        with self._lock:
            self.state.setdefault(name, {}).update(values)
            write_atomic(self.path, json.dumps(self.state, indent=1, sort_keys=True))


class _TrackerThread(threading.Thread):
    """Sends one tracker its records in order; a failure is reported once, then it only drains."""

    def __init__(self, sink: TrackerSink, state: _StateFile, sent: dict[str, int]) -> None:
        super().__init__(name=f"tracker-{sink.name}", daemon=True)
        self.sink = sink
        self.state = state
        self.sent = sent
        self.records: queue.Queue[Optional[tuple[int, dict[str, float]]]] = queue.Queue()
        self.failure: Optional[str] = None

    def run(self) -> None:
        while (item := self.records.get()) is not None:
            if self.failure is None:
                self._send(*item)
        if self.failure is None:
            try:
                self.sink.finish()
            except Exception as e:  # noqa: BLE001 - reported, the run's end goes on
                self._report(f"could not finish its run: {type(e).__name__}: {e}")

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        try:
            new = {}
            for key, value in metrics.items():
                name = self.sink.tracker_key(key)
                if step > self.sent.get(name, -1):  # not sent before (a resumed run's replay)
                    new[name] = value
            if not new:
                return
            self.sink.log(step, new)
            self.sent.update(dict.fromkeys(new, step))
            self.state.update(self.sink.name, run=self.sink.resume_state(),
                              sent=dict(self.sent))
        except Exception as e:  # noqa: BLE001 - reported once; training must not stop
            self._report(f"failed at step {step}: {type(e).__name__}: {e}")

    def _report(self, why: str) -> None:
        self.failure = why
        tqdm.write(f"[logging] {self.sink.name} {why}. It takes no more metrics; training goes on "
                   "(metrics.jsonl, tensorboard and any other tracker keep every step).",
                   file=sys.stderr)
        sys.stderr.flush()


class Trackers:
    """The trackers `config` enables, started (or continued: `fresh=False`) for the run in
    `run_dir`. `log` never blocks on a tracker; `close` waits for them at most
    `config.trackers_close_timeout_s`."""

    def __init__(self, config: LoggingConfig, run_dir: Path, run_config: dict[str, Any],
                 fresh: bool) -> None:
        self.close_timeout_s = config.trackers_close_timeout_s
        self._threads: list[_TrackerThread] = []
        sinks = build_sinks(config, run_dir, run_config)
        if not sinks:
            return
        state = _StateFile(run_dir / STATE_FILE, fresh)
        for sink in sinks:
            saved = state.saved(sink.name)
            try:
                sink.start(saved.get("run", {}))
                received = sink.received() if saved else {}
            except Exception as e:
                self.close()
                raise TrackerStartError(f"logging.{sink.name}: could not start: "
                                        f"{type(e).__name__}: {e}") from e
            # what the tracker holds, where it can tell; else what was sent to it
            sent = received if received is not None else dict(saved.get("sent", {}))
            state.update(sink.name, run=sink.resume_state(), sent=dict(sent))
            thread = _TrackerThread(sink, state, sent)
            thread.start()
            self._threads.append(thread)

    @property
    def enabled(self) -> bool:
        return bool(self._threads)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for thread in self._threads:
            thread.records.put((step, dict(metrics)))

    def failures(self) -> dict[str, str]:
        return {t.sink.name: t.failure for t in self._threads if t.failure is not None}

    def close(self) -> None:
        for thread in self._threads:
            thread.records.put(None)
        deadline = time.monotonic() + self.close_timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                left = thread.records.qsize()
                what = (f"had not taken the run's last {left} record(s)" if left else
                        "had not finished its run")
                tqdm.write(f"[logging] {thread.sink.name} {what} within "
                           f"logging.trackers_close_timeout_s={self.close_timeout_s:g} s; the "
                           "run ends without waiting for it (metrics.jsonl has every step).",
                           file=sys.stderr)
        self._threads = []
