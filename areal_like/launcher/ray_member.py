"""One actor of a Ray job as the driver sees it: its node, its process, the copy of its log,
and how it failed; a trainer rank's environment."""

from __future__ import annotations

import codecs
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from areal_like.utils.launcher_state import ATTEMPT_ENV, STATE_ENV
from areal_like.utils.network import interface_of
from areal_like.utils.progress import LIVE_BAR_ENV


class Member:
    """A server or trainer actor; `restarts` counts the times it was brought back."""

    def __init__(self, name: str, role: str, handle: Any, log: Path,
                 bundle: Optional[dict[str, float]] = None) -> None:
        self.name, self.role, self.handle, self.log = name, role, handle, log
        self.bundle = bundle or {}
        self.node: dict[str, Any] = {}
        self.pid: Optional[int] = None
        self.address = ""  # a server's host:port
        self.tail: deque[str] = deque(maxlen=200)
        self.log_file: Any = None  # a TidyLog, opened at its first output
        self.restarts = 0
        self.dead = False  # the actor itself died (Ray may be restarting it)
        self.failure = ""  # how its actor or process failed, until it is brought back
        self.healing: Any = None  # the Future of a server's restart in flight
        self.new_process()

    def new_process(self) -> None:
        """Read the actor's log from its start (a new process, or a restarted actor)."""
        self.offset, self.last_answer = 0, time.monotonic()
        self.pending: Any = None  # the ObjectRef of the poll in flight
        self.partial = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.exit_code: Optional[int] = None

    def where(self) -> str:
        node = self.node
        return (f"{self.name} (node {node.get('ip', '?')}, host {node.get('hostname', '?')}, "
                f"node id {str(node.get('node_id', '?'))[:12]})")

    def last_lines(self, n: int = 20) -> str:
        from engines.fleet.launch import meaningful_lines

        lines = meaningful_lines(list(self.tail), n)
        return "\n".join("    " + line for line in lines) or "    (no output)"

    def record(self) -> dict[str, Any]:
        """Its line of `actors.json`."""
        return {"name": self.name, "role": self.role, "pid": self.pid,
                "restarts": self.restarts, "address": self.address, **self.node}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3])[:600] if lines else type(e).__name__


def cause(e: BaseException) -> str:
    inner = getattr(e, "cause", None)
    return str(inner) if inner is not None else first_line(e)


def exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def trainer_env(config: Any, trainers: list[Member], trainer: Member, rank: int, master: str,
                port: int, node_dir: str, attempt: int, live_bar: bool) -> dict[str, str]:
    """The environment of trainer rank `rank` (one of `trainers`, placed on their nodes):
    torch.distributed's keys, the launcher's state file on its node, one thread per
    `launcher.threads_per_trainer`, the user's `launcher.trainer_env`, gloo on the address Ray
    knows the node by."""
    same_node = [m for m in trainers if m.node["node_id"] == trainer.node["node_id"]]
    env = {"RANK": str(rank), "WORLD_SIZE": str(config.launcher.n_trainer_procs),
           "LOCAL_RANK": "0" if trainer.node["gpu_ids"] else str(same_node.index(trainer)),
           "LOCAL_WORLD_SIZE": str(len(same_node)), "MASTER_ADDR": master,
           "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": str(config.launcher.threads_per_trainer),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           STATE_ENV: f"{node_dir}/launcher_state.json",
           ATTEMPT_ENV: str(attempt),
           # the actor puts its own folder first (the user's modules: tasks, rewards)
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    if live_bar:  # the console redraws rank 0's bar as one live line
        env[LIVE_BAR_ENV] = "1"
    env.update(config.launcher.trainer_env)  # rank keys are refused by the config
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(trainer.node["ip"])
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    return env
