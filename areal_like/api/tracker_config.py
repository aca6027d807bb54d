"""The experiment trackers the metrics also go to (`logging.wandb` / `mlflow` / `trackio`).

Each is an extra (`pip install 'areal-like[wandb]'`, `[mlflow]`, `[trackio]`) and off by default;
metrics.jsonl, tensorboard and the PNG are written either way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from areal_like.api.config_checks import above, bounded, check_bounds, choices


def check_tracker(config: Any, section: str) -> None:
    """The bounds of a tracker's section, and none of its settings set while it is off
    (nothing would read them: a forgotten `enabled=true`)."""
    check_bounds(config, section)
    if config.enabled:
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name != "enabled" and value != f.default:
            raise ValueError(f"logging.{section}.{f.name}={value!r} is set but "
                             f"logging.{section}.enabled=false: nothing reads it; set "
                             f"logging.{section}.enabled=true, or unset it")


@dataclass
class WandbConfig:
    """Weights & Biases. `offline` writes the run under `<run dir>/wandb` (no account;
    `wandb sync` uploads it later); `online` needs `WANDB_API_KEY` or `wandb login`."""

    enabled: bool = False
    mode: str = bounded("offline", bound=choices("offline", "online"))
    project: str = ""  # "": logging.experiment_name
    entity: str = ""  # "": the API key's default entity

    def __post_init__(self) -> None:
        check_tracker(self, "wandb")


@dataclass
class MLflowConfig:
    """MLflow: a tracking server (`http://host:port`) or a store the client writes itself
    (`sqlite:///path.db`). "" : `sqlite:///<run dir>/mlflow.db`."""

    enabled: bool = False
    tracking_uri: str = ""
    experiment: str = ""  # "": logging.experiment_name
    # how long the start waits for the tracking server to answer before failing the run
    start_timeout_s: float = bounded(30.0, bound=above(0))

    def __post_init__(self) -> None:
        check_tracker(self, "mlflow")


@dataclass
class TrackioConfig:
    """Trackio in its local mode: an SQLite file per project under `dir` (`trackio show`
    serves the dashboard)."""

    enabled: bool = False
    project: str = ""  # "": logging.experiment_name
    dir: str = ""  # "": trackio's own default (TRACKIO_DIR, else ~/.cache/huggingface/trackio)

    def __post_init__(self) -> None:
        check_tracker(self, "trackio")

