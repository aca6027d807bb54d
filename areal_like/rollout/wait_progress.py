"""No wait for a batch is silent: a line every `PROGRESS_INTERVAL_S` while it lasts.

The executor runs in the rollout controller process, whose log lines go to the trainer's
stderr and from there to the launcher's console (`[trainer] ... [rollout-controller] ...`).
A wait shorter than the interval prints nothing, so a healthy run stays quiet.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 30.0  # < 60 s: nobody stares at a silent screen for a minute


class WaitProgress:
    """Logs what one wait is waiting for, at most once per interval (see `tick`)."""

    def __init__(self, what: str, count: int) -> None:
        self.what = what
        self.count = count
        self.start = time.monotonic()
        self._next = self.start + PROGRESS_INTERVAL_S  # the module constant, read now

    def tick(self, ready: int, describe: Callable[[], str]) -> None:
        """Call after each wake-up of the wait; logs when an interval has passed since the
        wait began or since the last line. `describe` is called only then."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + PROGRESS_INTERVAL_S
        logger.info("%s still waiting after %.0f s: %d of %d groups ready; %s", self.what,
                    now - self.start, ready, self.count, describe())
