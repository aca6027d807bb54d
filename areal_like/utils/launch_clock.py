"""One clock for a run's start-up and shut-down: seconds since the launch.

The launcher puts the moment its own process started into the environment
(`AREAL_LIKE_LAUNCHED_AT`, unix seconds) before it starts anything, so the trainer's ranks,
started by torchrun, stamp their phases on the same clock as the launcher's lines. A process
started without a launcher counts from its own start. Light on purpose: no torch, so the
launcher can import it before anything heavy.
"""

from __future__ import annotations

import os
import time

LAUNCHED_AT_ENV = "AREAL_LIKE_LAUNCHED_AT"
_IMPORTED_AT = time.time()


def process_started_at() -> float:
    """Unix time at which this process started (Linux: from /proc, to 10 ms), else when this
    module was imported."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (after the parenthesised command, which may hold spaces): start time in
            # clock ticks after boot, on the clock CLOCK_BOOTTIME reads
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


def launched_at() -> float:
    """Unix time of the launch: the launcher's start, or this process's own."""
    value = os.environ.get(LAUNCHED_AT_ENV, "")
    try:
        return float(value) if value else process_started_at()
    except ValueError:
        return process_started_at()


def mark_launch() -> None:
    """Make this process's start the launch of everything it starts (kept when a launcher
    above it already set it)."""
    os.environ.setdefault(LAUNCHED_AT_ENV, repr(launched_at()))


def since_launch() -> float:
    return time.time() - launched_at()


def stamp() -> str:
    """`+12.3 s`: the time since the launch, for a line of start-up or shut-down."""
    return f"+{since_launch():.1f} s"


class Phases:
    """Named moments of a process's start-up (or shut-down), in seconds since the launch, said
    as one line (`summary`) when it is over. The first is this process's start, or now."""

    def __init__(self, first: str = "process started", from_process_start: bool = True) -> None:
        at = process_started_at() - launched_at() if from_process_start else since_launch()
        self._marks: list[tuple[str, float]] = [(first, at)]

    def mark(self, name: str) -> None:
        self._marks.append((name, since_launch()))

    def summary(self) -> str:
        return ", ".join(f"{name} {at:.1f}" for name, at in self._marks)
