"""The processes of a Ray job, each owned by an actor on the node Ray placed it on: one SGLang
server or one trainer rank.

An actor starts its process with PR_SET_PDEATHSIG, so when the actor dies (killed, node lost,
driver gone) its process gets SIGTERM and takes its own children with it: nothing is orphaned.
The driver polls each actor for its process's exit code and the new bytes of its log, which it
copies under the run's log directory (so logs of every node end up in one place).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from areal_like.api.config import ServerConfig
from areal_like.utils.atomic_file import write_atomic
from areal_like.utils.network import bindable, find_free_port

if TYPE_CHECKING:
    from engines.fleet.launch import ServerProcess

PORT_FREE_WITHIN_S = 30.0


def _with_cwd_on_path(env: dict[str, str]) -> dict[str, str]:
    """The actor's folder first on the trainer's path: the user's modules (tasks, rewards
    named in config) import as on the driver (a Ray Job's working_dir is unpacked per node)."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def _wait_bindable(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not bindable(host, port, reuse_addr=True):  # SGLang's server sets it
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class ProcessLost(RuntimeError):
    """Polled without a process: Ray restarted this actor (its old process died with it)."""


class ProcessActor:
    """Plain class; the Ray launcher wraps it with `ray.remote` (so importing it needs no Ray)."""

    def __init__(self, name: str, cwd: str, log_dir: str) -> None:
        import ray

        self.name = name
        self.ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        if ray.get_runtime_context().runtime_env.working_dir():
            pass  # a Ray Job's working_dir: Ray unpacked it on this node and started us in it
        elif not Path(cwd).is_dir():
            raise RuntimeError(f"{name}: the working directory {cwd} does not exist on node "
                               f"{self.ip}: install the project at the same path on every node, "
                               f"or submit the run as a Ray Job with --working-dir")
        else:
            os.chdir(cwd)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}.log"
        self.process: Optional[ServerProcess] = None
        self.fleet: Any = None

    def node(self) -> dict[str, Any]:
        import ray

        return {"ip": self.ip, "node_id": self.node_id, "hostname": socket.gethostname(),
                "actor_pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def rendezvous_port(self, port: int) -> int:
        """`port` if it can be bound on this node's address (0: a free one); else an error."""
        if port == 0:
            return find_free_port(self.ip)
        if not bindable(self.ip, port):
            raise RuntimeError(f"launcher.master_port={port} is in use on {self.ip}; choose "
                               f"another, or 0 for a free one")
        return port

    def start_server(self, model_path: str, config: ServerConfig,
                     api_key: Optional[str], address: str = "") -> str:
        """Start one SGLang server bound to this node's address; its `host:port` once healthy
        (ServerStartError with its log tail otherwise). `address`: the one a restarted server
        had; kept when it is on this node and its port frees within `PORT_FREE_WITHIN_S` (the
        dead server's processes may still hold it), so clients find it where it was."""
        from engines.fleet.launch import InferenceFleet

        host, _, port = address.rpartition(":")
        keep = host == self.ip and _wait_bindable(self.ip, int(port), PORT_FREE_WITHIN_S)
        fleet = InferenceFleet(model_path, replace(config, n_servers=1), host=self.ip,
                               base_port=int(port) if keep else None,
                               api_key=api_key, log_dir=self.log_dir / self.name)
        fleet.start()
        self.fleet, self.process, self.log_path = fleet, fleet.processes[0], fleet.log_paths[0]
        return fleet.addresses[0]

    def start_process(self, argv: list[str], env: dict[str, str]) -> int:
        """Start a trainer rank; its pid."""
        from engines.fleet.launch import die_with_parent

        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=_with_cwd_on_path(dict(os.environ, **env)), start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()))
        self.process = process
        return process.pid

    def write_text(self, path: str, text: str) -> None:
        """Replace a file on this node at once (what the launcher tells rank 0 here)."""
        write_atomic(path, text)

    def poll(self, offset: int, limit: int = 1 << 20) -> tuple[Optional[int], bytes]:
        """(the process's exit code or None while it runs, its log from `offset`). The driver
        polls only actors it started a process on: one without was restarted by Ray, perhaps
        before the driver saw the old one die, and says so (ProcessLost)."""
        if self.process is None:
            raise ProcessLost(f"{self.name}'s actor was restarted by Ray (pid {os.getpid()}); "
                              f"the process it had started is gone")
        code = self.process.poll()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return code, f.read(limit)
        except FileNotFoundError:
            return code, b""

    def child_pids(self) -> list[int]:
        pid = self.process.pid if self.process is not None else None
        return [pid] if pid is not None else []

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """Stop the process (its whole session: a trainer's rollout and reward processes too)."""
        if self.fleet is not None:
            self.fleet.stop(timeout)
        elif self.process is not None and self.process.poll() is None:
            assert self.process.pid is not None  # a trainer rank: started by command
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return self.process.poll() if self.process is not None else None
