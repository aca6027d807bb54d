"""Trackio in its local mode: one Trackio run per run, continued by a resumed run.

Trackio finds a run by its name; a new run whose trial name a run of the project already has
takes the next free `<trial>-N`, so a resume never joins someone else's run."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any, Optional

from areal_like.api.config import LoggingConfig
from areal_like.utils.trackers.base import install_hint


class TrackioSink:
    name = "trackio"

    def __init__(self, config: LoggingConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        self.config = config.trackio
        self.project = self.config.project or config.experiment_name
        self.trial_name = config.trial_name
        self.run_config = run_config
        self._run: Any = None
        self._name = ""

    def start(self, saved: dict[str, Any]) -> None:
        if self.config.dir:
            where = str(Path(self.config.dir).resolve())
            if "trackio" in sys.modules and os.environ.get("TRACKIO_DIR") != where:
                raise RuntimeError(f"trackio was imported before logging.trackio.dir={where} "
                                   "could be set (it reads TRACKIO_DIR once)")
            os.environ["TRACKIO_DIR"] = where  # read by trackio at import
        try:
            import trackio
            from trackio.sqlite_storage import SQLiteStorage
        except ImportError as e:
            raise ImportError(install_hint(self.name)) from e
        self._storage = SQLiteStorage
        self._name = saved.get("name") or self._free_name()
        with contextlib.redirect_stdout(io.StringIO()):  # its banner: where the dashboard is
            self._run = trackio.init(
                project=self.project, name=self._name, config=self.run_config,
                resume="must" if saved.get("name") else "never", embed=False,
                auto_log_cpu=False, auto_log_gpu=False)

    def _free_name(self) -> str:
        taken = set(self._storage.get_runs(self.project))
        name, n = self.trial_name, 1
        while name in taken:
            n += 1
            name = f"{self.trial_name}-{n}"
        return name

    def resume_state(self) -> dict[str, Any]:
        return {"name": self._name, "project": self.project}

    def tracker_key(self, key: str) -> str:
        return key

    def received(self) -> Optional[dict[str, int]]:
        """The last step of every metric the local store holds for this run (what Trackio
        had queued but not written when the run was killed is not there, and is sent again)."""
        last: dict[str, int] = {}
        for record in self._storage.get_logs(self.project, run=self._name):
            for key in record:
                if key not in ("step", "timestamp"):
                    last[key] = max(last.get(key, -1), int(record["step"]))
        return last

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self._run.finish()
