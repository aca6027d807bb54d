"""What a session of runs spends starting things: servers, trainers, clusters, installs.

Where `AREAL_LIKE_START_LOG` names a file (the test command sets it), every start appends one
JSON line `{"kind", "seconds", "what"}` when it is over: an inference server until it answers
`/health` (and each restart), a trainer from its process's start to its first step, a Ray node,
a Slurm test cluster, the install step. `summarize` sums them by kind: the table at the end of
the test command (tests/conftest.py). Nothing is written where the variable is unset.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

START_LOG_ENV = "AREAL_LIKE_START_LOG"
_warned = False


def record_start(kind: str, seconds: float, what: str = "") -> None:
    """Append one start to the log (one `write` in append mode: lines from many processes do
    not interleave). Accounting only: a log that cannot be written is said once on stderr and
    the start goes on."""
    global _warned
    path = os.environ.get(START_LOG_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "seconds": round(seconds, 3), "what": what}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        if not _warned:
            _warned = True
            print(f"[start costs] cannot write {START_LOG_ENV}={path}: {e}; starts of this "
                  f"process are not counted", file=sys.stderr, flush=True)


@dataclass
class KindTotal:
    kind: str
    count: int
    seconds: float


def summarize(path: str | Path) -> list[KindTotal]:
    """Starts by kind, most seconds first (a line that is not a record is skipped: a process
    killed mid-write)."""
    totals: dict[str, KindTotal] = {}
    file = Path(path)
    if not file.is_file():
        return []
    for raw in file.read_text().splitlines():
        try:
            record = json.loads(raw)
            kind, seconds = str(record["kind"]), float(record["seconds"])
        except (ValueError, KeyError, TypeError):
            continue
        total = totals.setdefault(kind, KindTotal(kind, 0, 0.0))
        total.count += 1
        total.seconds += seconds
    return sorted(totals.values(), key=lambda t: -t.seconds)
