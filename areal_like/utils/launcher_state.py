"""What a launcher tells a running trainer: its restart counts, through a small JSON file on
trainer rank 0's node that the launcher rewrites and rank 0 reads with every metrics record.

The file's path comes in `$AREAL_LIKE_LAUNCHER_STATE`; without it (a trainer started by hand
or by the local launcher) there is nothing to add.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_ENV = "AREAL_LIKE_LAUNCHER_STATE"
ATTEMPT_ENV = "AREAL_LIKE_TRAINER_ATTEMPT"  # 0: the first start; n: the n-th restart


def launcher_metrics() -> dict[str, float]:
    """`launcher/<count>` for every count in the launcher's state file ({} without one)."""
    path = os.environ.get(STATE_ENV)
    if not path:
        return {}
    try:
        counts = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    return {f"launcher/{key}": float(value) for key, value in counts.items()}


def trainer_attempt() -> int:
    """How many times the launcher restarted this trainer (0 on its first start)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))
