"""Experiment trackers (W&B, MLflow, Trackio) as metric sinks: `Trackers` feeds every one the
run enabled under `logging`, each from a thread of its own."""

from areal_like.utils.trackers.fanout import Trackers, TrackerStartError, check_trackers

__all__ = ["TrackerStartError", "Trackers", "check_trackers"]
