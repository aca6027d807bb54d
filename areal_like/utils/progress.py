"""The run's one progress indicator, readable in a terminal and in a file.

On a terminal (or under a launcher whose console is one: it sets `LIVE_BAR_ENV` and redraws
the bar itself) a tqdm bar; anywhere else (a log file, CI, a pipe) a plain line at every tenth
of the run, never a carriage-return redraw that glues bar fragments to metric lines.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

LIVE_BAR_ENV = "AREAL_LIKE_LIVE_BAR"


def live_bar() -> bool:
    """Whether this process draws a live bar (its stderr is a terminal, or a launcher whose
    console is a terminal said so)."""
    return sys.stderr.isatty() or os.environ.get(LIVE_BAR_ENV) == "1"


def progress(steps: range, desc: str, enabled: bool = True) -> Iterator[int]:
    """Iterate `steps` (a run's range from its first step to its total), showing progress."""
    if not enabled:
        yield from steps
    elif live_bar():
        yield from tqdm(steps, initial=steps.start, total=steps.stop, desc=desc,
                        mininterval=5.0, file=sys.stderr)
    else:
        yield from _tenths(steps, desc)


def _tenths(steps: range, desc: str) -> Iterator[int]:
    total, start = steps.stop, time.monotonic()
    shown = -1
    for step in steps:
        yield step
        done = step + 1
        tenth = done * 10 // total if total else 10
        if tenth > shown:
            shown = tenth
            elapsed = time.monotonic() - start
            rate = (done - steps.start) / elapsed if elapsed > 0 else 0.0
            left = f", ~{_clock((total - done) / rate)} left" if rate and done < total else ""
            print(f"{desc}: {done}/{total} ({100 * done // total}%), {_clock(elapsed)} "
                  f"elapsed{left}", flush=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
