"""CPU time of every process of a run, by role, sampled from /proc while the run goes on.

Roles: the trainer (a `recipes.*` process), the rollout controller (the trainer's spawned
child), reward workers (the controller's children), the SGLang server's HTTP/tokenizer
process, its scheduler and its detokenizer, and the rest (launcher, torchrun). A process's
last sample is its total; one that lives shorter than the sampling interval is missed.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _read(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds user + system, "name: command line") of `pid`, None once it
    is gone. The name matters: SGLang names its subprocesses (`sglang::scheduler`) there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, f"{name}: {cmd}"


def _role(cmd: str, parent_cmd: str, grandparent_cmd: str) -> str:
    if "recipes." in cmd:
        return "trainer"
    if "sglang::sched" in cmd:
        return "server scheduler"
    if "sglang::detok" in cmd:
        return "server detokenizer"
    if "sglang.launch_server" in cmd:
        return "server HTTP/tokenizer"
    if "launch_server" in parent_cmd or "launch_server" in grandparent_cmd:
        return "server (other)"
    if "spawn_main" in cmd and "recipes." in parent_cmd:
        return "rollout controller"
    if "recipes." in grandparent_cmd or "pebble" in cmd:
        return "reward workers"
    return "launcher/torchrun"


class ProcessCPU:
    """Sample the process tree under `root_pid` every `interval` s in a thread."""

    def __init__(self, root_pid: int, interval: float = 0.5) -> None:
        self.root, self.interval = root_pid, interval
        self.seen: dict[int, tuple[int, float, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ProcessCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        now: dict[int, tuple[int, float, str]] = {}
        children: dict[int, list[int]] = defaultdict(list)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (info := _read(int(entry.name))) is not None:
                now[int(entry.name)] = info
                children[info[0]].append(int(entry.name))
        stack = [self.root]
        while stack:
            pid = stack.pop()
            if pid in now:
                self.seen[pid] = now[pid]
            stack.extend(children.get(pid, []))

    def by_role(self) -> dict[str, float]:
        """Total CPU seconds per role."""
        cmd = {pid: info[2] for pid, info in self.seen.items()}
        parent = {pid: info[0] for pid, info in self.seen.items()}
        totals: dict[str, float] = defaultdict(float)
        for ppid, cpu, command in self.seen.values():
            grand = cmd.get(parent.get(ppid, -1), "")
            totals[_role(command, cmd.get(ppid, ""), grand)] += cpu
        return dict(totals)
