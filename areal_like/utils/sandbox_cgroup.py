"""The whole sandbox's memory and process count, bounded together: a cgroup per run.

RLIMIT_AS and RLIMIT_NPROC bound one process (or one uid) each: five children of a sandboxed
program held 4 GiB together under a 1 GiB limit. A cgroup bounds everything the run starts,
RAM-backed files of its tmpfs included (the kernel charges their pages to it). The memory and
pids controllers of cgroup v1 (`/sys/fs/cgroup/{memory,pids}`) or v2 (`/sys/fs/cgroup`) are
used, whichever this machine has; creating one needs root (or a delegated subtree).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")
_PREFIX = "areal_like_sandbox_"


def _own_path(controller: str) -> str:
    """This process's cgroup path in the hierarchy of `controller` ("" for v2's)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(",") or (not controller and not controllers):
                return path.lstrip("/")
    return ""


def _v1_dirs() -> Optional[dict[str, Path]]:
    dirs = {c: ROOT / c / _own_path(c) for c in ("memory", "pids")}
    ok = all((d / "cgroup.procs").exists() for d in dirs.values())
    return dirs if ok else None


def _v2_dir() -> Optional[Path]:
    base = ROOT / _own_path("")
    try:
        enabled = (base / "cgroup.subtree_control").read_text().split()
    except OSError:
        return None
    return base if {"memory", "pids"} <= set(enabled) else None


def unavailable_reason() -> Optional[str]:
    """Why a run's cgroup cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "it takes root to make a cgroup per run (this process is not root)"
    if _v1_dirs() is None and _v2_dir() is None:
        return (f"no writable memory and pids cgroup controllers under {ROOT} (cgroup v1 "
                f"memory/ and pids/, or v2 with both in cgroup.subtree_control)")
    for parent in _parents():
        if not os.access(parent, os.W_OK):
            return f"{parent} is not writable"
    return None


def _parents() -> list[Path]:
    v1 = _v1_dirs()
    if v1 is not None:
        return list(v1.values())
    v2 = _v2_dir()
    return [v2] if v2 is not None else []


class RunCgroup:
    """One run's cgroup (memory and pids); `enter()` in the run's first process (before it
    execs), `close()` after: kills what is left in it and removes it."""

    def __init__(self, name: str, memory_bytes: int, processes: int) -> None:
        v1 = _v1_dirs()
        if v1 is not None:
            self.dirs = [v1["memory"] / f"{_PREFIX}{name}", v1["pids"] / f"{_PREFIX}{name}"]
            settings = {self.dirs[0] / "memory.limit_in_bytes": memory_bytes,
                        self.dirs[1] / "pids.max": processes,
                        # RAM and swap together (absent without swap accounting)
                        self.dirs[0] / "memory.memsw.limit_in_bytes": memory_bytes}
        else:
            v2 = _v2_dir()
            if v2 is None:
                raise OSError(unavailable_reason() or "no cgroup controllers")
            self.dirs = [v2 / f"{_PREFIX}{name}"]
            settings = {self.dirs[0] / "memory.max": memory_bytes,
                        self.dirs[0] / "memory.swap.max": 0,
                        self.dirs[0] / "pids.max": processes}
        self.v1 = v1 is not None
        for d in self.dirs:
            d.mkdir(exist_ok=True)
        for path, value in settings.items():
            if path.exists():
                path.write_text(str(value))

    def enter(self) -> None:
        """Move the calling process in (its children are born inside)."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def hit_memory_limit(self) -> bool:
        """Whether the run reached its memory limit (an allocation failed or the OOM killer ran
        inside it)."""
        memory = self.dirs[0]
        try:
            if self.v1:  # (a limit on RAM + swap counts in memsw's; the OOM killer's kills)
                counts = [int(f.read_text()) for f in (memory / "memory.failcnt",
                                                         memory / "memory.memsw.failcnt")
                          if f.exists()]
                oom = dict(line.split() for line in
                           (memory / "memory.oom_control").read_text().splitlines())
                return any(counts) or int(oom.get("oom_kill", 0)) > 0
            events = dict(line.split() for line in
                          (memory / "memory.events").read_text().splitlines())
            return int(events.get("max", 0)) > 0 or int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill every process still in it, then remove it (a cgroup with processes cannot be
        removed)."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"processes {pids} of {d} outlived their kill")
                time.sleep(0.05)
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()
