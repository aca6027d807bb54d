"""Weights & Biases: one W&B run per run, continued by a resumed run (same id).

Rows carry our `step` as their x-axis (`define_metric`): an evaluation that finishes after
later steps is its own row at its own step, while W&B's row counter (`_step`, which must only
grow) is kept in trackers.json across resumes.

A resumed offline run reads what the earlier folders of its run hold with W&B's own reader
(`wandb leet inspect`): rows W&B had been handed but not written when the run was killed are
sent again. An online run relies on trackers.json for that."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from areal_like.api.config import LoggingConfig
from areal_like.utils.trackers.base import install_hint

STEP_KEY = "step"
W_AND_B_KEYS = {STEP_KEY, "_step", "_runtime", "_timestamp", "_wandb"}  # not our metrics


def _history(folder: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run folder, as `wandb leet inspect --json` reads them."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                          str(folder)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {folder} failed: {out.stderr.strip()[-500:]}")
    records = (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


class WandbSink:
    name = "wandb"

    def __init__(self, config: LoggingConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        self.config = config.wandb
        self.project = self.config.project or config.experiment_name
        self.trial_name = config.trial_name
        self.run_dir = run_dir
        self.run_config = run_config
        self._run: Any = None
        self._id = ""
        self._rows = 0

    def start(self, saved: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(install_hint(self.name)) from e
        self._id = saved.get("id") or secrets.token_hex(4)  # W&B's ids: [a-z0-9]
        self._rows = int(saved.get("rows", 0))
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                  x_save_requirements=False)
        self._run = wandb.init(
            mode="online" if self.config.mode == "online" else "offline",
            project=self.project, entity=self.config.entity or None,
            name=self.trial_name, id=self._id, resume="allow", dir=str(self.run_dir),
            config=self.run_config, settings=settings)
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def resume_state(self) -> dict[str, Any]:
        return {"id": self._id, "rows": self._rows}

    def tracker_key(self, key: str) -> str:
        return key

    def received(self) -> Optional[dict[str, int]]:
        if self.config.mode != "offline":
            return None
        current = Path(self._run.dir).parent
        last: dict[str, int] = {}
        for folder in sorted((self.run_dir / "wandb").glob(f"offline-run-*-{self._id}")):
            if folder.resolve() == current.resolve():
                continue
            for item in _history(folder):
                for key in item.keys() - W_AND_B_KEYS:
                    last[key] = max(last.get(key, -1), int(item[STEP_KEY]))
                self._rows = max(self._rows, int(item.get("_step", -1)) + 1)
        return last

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({**metrics, STEP_KEY: step}, step=self._rows)
        self._rows += 1

    def finish(self) -> None:
        self._run.finish()
