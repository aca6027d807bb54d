"""What a tracker sink is: start (or continue) a tracker run, take one step's metrics, finish."""

from __future__ import annotations

from typing import Any, Optional, Protocol


class TrackerSink(Protocol):
    """One experiment tracker. Its calls come from one thread (the tracker's own)."""

    name: str  # the `logging` section that enables it: "wandb", "mlflow", "trackio"

    def start(self, saved: dict[str, Any]) -> None:
        """Start a tracker run, or continue the one `saved` names (a resumed run: what
        `resume_state` last said)."""
        ...

    def resume_state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this tracker run (saved after every record)."""
        ...

    def tracker_key(self, key: str) -> str:
        """The name `key` takes in this tracker (some refuse characters our names use)."""
        ...

    def received(self) -> Optional[dict[str, int]]:
        """Per tracker key, the last step the tracker holds (read from the tracker on a
        resume), or None where the tracker cannot tell."""
        ...

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Send one record: `metrics` (tracker keys) of `step`."""
        ...

    def finish(self) -> None:
        ...


def install_hint(name: str) -> str:
    return (f"logging.{name}.enabled=true but {name} is not installed: "
            f"pip install 'areal-like[{name}]'")
