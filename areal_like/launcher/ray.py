"""Ray launcher: the SGLang servers and the trainer ranks as actors on an existing Ray cluster.

    python -m areal_like.launcher.ray <recipe> [--config FILE] [key=value ...]
    python -m areal_like.launcher.ray path/to/train.py --config FILE [key=value ...]

Connects to `launcher.ray_address` ('auto' by default), reserves one placement group for the
servers (`server.n_servers` x `launcher.cpus_per_server` CPUs, `server.gpus_per_server` GPUs on
CUDA) and one for the trainer ranks (`launcher.n_trainer_procs` x `launcher.cpus_per_trainer`
CPUs, `launcher.gpus_per_trainer` GPUs), starts each server on its node's address and then the
trainer ranks as one torch.distributed job (rank 0's node hosts the rendezvous). Weights reach the
servers by `rollout.weight_transport`: `distributed` always works across nodes; `disk` needs the
servers on trainer rank 0's node or `launcher.shared_dir`. Logs of every actor are copied to
`<run dir>/logs/`. Any actor or process that dies stops the job, naming it, its node and its
last log lines; every process is stopped on the way out (Ctrl-C too).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from areal_like.launcher.console import Console, TidyLog
from areal_like.launcher.ray_cluster import connect, plan, reserve
from areal_like.launcher.target import (
    LaunchError,
    TrainTarget,
    check_model_path,
    launcher_main,
    resolve_target,
    trainer_error,
)
from areal_like.utils.metrics_logger import run_dir
from areal_like.utils.network import interface_of
from areal_like.utils.progress import LIVE_BAR_ENV

POLL_INTERVAL = 0.5
STOP_TIMEOUT = 30.0
CONSOLE = Console()


class _Member:
    """One actor of the job, as the driver sees it."""

    def __init__(self, name: str, role: str, handle: Any, log: Path) -> None:
        self.name, self.role, self.handle, self.log = name, role, handle, log
        self.node: dict[str, Any] = {}
        self.pid: Optional[int] = None
        self.offset, self.last_answer = 0, time.monotonic()
        self.pending: Any = None  # the ObjectRef of the poll in flight
        self.tail: deque[str] = deque(maxlen=200)
        self.partial = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.exit_code: Optional[int] = None
        self.dead = False
        self.log_file: Optional[TidyLog] = None  # opened at its first output

    def where(self) -> str:
        node = self.node
        return (f"{self.name} (node {node.get('ip', '?')}, host {node.get('hostname', '?')}, "
                f"node id {str(node.get('node_id', '?'))[:12]})")

    def last_lines(self, n: int = 20) -> str:
        from engines.sglang_server import meaningful_lines

        lines = meaningful_lines(list(self.tail), n)
        return "\n".join("    " + line for line in lines) or "    (no output)"


def _replace_overrides(overrides: list[str], extra: list[str]) -> list[str]:
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + extra


class RayJob:
    def __init__(self, target: TrainTarget) -> None:
        self.target, self.config = target, target.config
        self.members: list[_Member] = []
        self.groups: list[Any] = []
        self.log_dir = run_dir(self.config.logging) / "logs"
        self.echo = True

    # -- start ---------------------------------------------------------------------------------
    def _spawn(self, role: str, index: int, group: Any, bundle: dict[str, float]) -> _Member:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal_like.launcher.ray_actors import ProcessActor

        name = f"{role}_{index}"
        handle = ray.remote(ProcessActor).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index),
        ).remote(name, os.getcwd(), f"/tmp/areal_like_ray/{self.run_id}")
        member = _Member(name, role, handle, self.log_dir / f"{name}.log")
        self.members.append(member)
        return member

    def start(self) -> None:
        import ray

        config, launcher = self.config, self.config.launcher
        if launcher.shared_dir:  # the run directory (weights too) on storage every node sees
            self.target.overrides = _replace_overrides(
                self.target.overrides, [f"logging.log_dir={launcher.shared_dir}"])
            config.logging.log_dir = launcher.shared_dir
            self.log_dir = run_dir(config.logging) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        address = connect(launcher.ray_address)
        CONSOLE.line(f"[launcher] connected to the Ray cluster at {address}: "
                     f"{ray.cluster_resources()}")
        self.run_id = f"{config.logging.experiment_name}_{config.logging.trial_name}_{os.getpid()}"
        fleet = self.target.needs_fleet and not config.rollout.server_addrs
        alloc = plan(config, config.server.n_servers if fleet else 0)
        servers, trainers = [], []
        if alloc.n_servers:
            self.groups.append(reserve(f"{self.run_id}_servers", [alloc.server] * alloc.n_servers,
                                       launcher.placement_strategy, launcher.placement_timeout))
            servers = [self._spawn("server", i, self.groups[-1], alloc.server)
                       for i in range(alloc.n_servers)]
        self.groups.append(reserve(f"{self.run_id}_trainers", [alloc.trainer] * alloc.n_trainers,
                                   launcher.placement_strategy, launcher.placement_timeout))
        trainers = [self._spawn("trainer", r, self.groups[-1], alloc.trainer)
                    for r in range(alloc.n_trainers)]
        nodes = self._gather([(m, m.handle.node.remote()) for m in self.members],
                             launcher.placement_timeout, "start")
        for member, node in zip(self.members, nodes, strict=True):
            member.node = node
        self._check_weight_path(servers, trainers[0])
        port = self._gather([(trainers[0], trainers[0].handle.rendezvous_port.remote(
            launcher.master_port))], 60, "reserve the rendezvous port")[0]
        extra = []
        if servers:
            CONSOLE.line(f"[launcher] starting {len(servers)} {config.server.backend} server(s) on "
                         f"{config.model.path}")
            calls = [(s, s.handle.start_server.remote(config.model.path, config.server,
                                                      config.rollout.api_key)) for s in servers]
            addrs = self._gather(calls, config.server.startup_timeout + 60, "start its server")
            CONSOLE.line(f"[launcher] servers ready: {addrs}")
            extra.append(f"rollout.server_addrs=[{','.join(addrs)}]")
        rank0_ip = trainers[0].node["ip"]
        if config.rollout.weight_transport == "distributed":
            extra.append(f"rollout.weight_group_addr={rank0_ip}")
        argv = [*self.target.entry, "--config", str(self.target.config_path),
                *_replace_overrides(self.target.overrides, extra)]
        CONSOLE.line(f"[launcher] {len(trainers)} trainer rank(s), rendezvous "
                     f"{rank0_ip}:{port}: python {' '.join(argv)}")
        pids = self._gather([(t, t.handle.start_process.remote(
            [sys.executable, *argv], self._env(t, r, rank0_ip, port)))
            for r, t in enumerate(trainers)], 60, "start its trainer")
        for t, pid in zip(trainers, pids, strict=True):
            t.pid = pid
        for s in servers:
            s.pid = self._gather([(s, s.handle.child_pids.remote())], 60, "report its pid")[0][0]
        (self.log_dir / "actors.json").write_text(json.dumps(
            [{"name": m.name, "role": m.role, "pid": m.pid, **m.node} for m in self.members],
            indent=1))

    def _env(self, trainer: _Member, rank: int, master: str, port: int) -> dict[str, str]:
        same_node = [m for m in self.members if m.role == "trainer"
                     and m.node["node_id"] == trainer.node["node_id"]]
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.config.launcher.n_trainer_procs),
               "LOCAL_RANK": "0" if trainer.node["gpu_ids"] else str(same_node.index(trainer)),
               "LOCAL_WORLD_SIZE": str(len(same_node)), "MASTER_ADDR": master,
               "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(self.config.launcher.threads_per_trainer),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               # the user's modules (tasks, rewards named in config) import as on the driver
               "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                          os.environ.get("PYTHONPATH")]))}
        if CONSOLE.tty:  # the console redraws rank 0's bar as one live line
            env[LIVE_BAR_ENV] = "1"
        env.update(self.config.launcher.trainer_env)  # rank keys are refused by the config
        # gloo on the address Ray knows the node by
        if "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = interface_of(trainer.node["ip"])
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
        return env

    def _check_weight_path(self, servers: list[_Member], rank0: _Member) -> None:
        config = self.config
        if config.rollout.weight_transport != "disk" or config.launcher.shared_dir:
            return
        away = [s.where() for s in servers if s.node["node_id"] != rank0.node["node_id"]]
        if away:
            raise LaunchError(
                f"{', '.join(away)} {'is' if len(away) == 1 else 'are'} not on the node of "
                f"{rank0.where()}, so cannot read the weights it writes to disk: set "
                f"rollout.weight_transport=distributed, or launcher.shared_dir=<a folder every "
                f"node mounts at the same path>")

    def _gather(self, calls: list[tuple[_Member, Any]], timeout: float, what: str) -> list[Any]:
        """The results of one call per member, or LaunchError naming the member that failed."""
        import ray

        out = []
        deadline = time.monotonic() + timeout
        for member, ref in calls:
            try:
                out.append(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise LaunchError(f"{member.where()} did not {what} within {timeout:g} s "
                                  f"(is the cluster overloaded?)") from None
            except ray.exceptions.RayActorError as e:
                member.dead = True
                raise LaunchError(f"{member.where()} died before it could {what}: "
                                  f"{_first_line(e)}") from None
            except Exception as e:  # the actor's own error, e.g. a server that did not start
                raise LaunchError(f"{member.where()} failed to {what}: {_cause(e)}") from None
        return out

    # -- run -----------------------------------------------------------------------------------
    def watch(self) -> int:
        """Stream logs until every trainer rank exits; 0, or LaunchError when anything fails."""
        import ray

        unresponsive = self.config.launcher.actor_unresponsive_timeout
        trainers = [m for m in self.members if m.role == "trainer"]
        while True:
            for m in self.members:
                if m.pending is None:
                    m.pending = m.handle.poll.remote(m.offset)
            pending = [m.pending for m in self.members]
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_INTERVAL)
            for m in self.members:
                if m.pending in ready:
                    self._take(m)
                elif time.monotonic() - m.last_answer > unresponsive:
                    raise LaunchError(f"{m.where()} has not answered for {unresponsive:g} s "
                                      f"(launcher.actor_unresponsive_timeout); last lines of "
                                      f"{m.log}:\n{m.last_lines()}")
            for m in self.members:
                if m.exit_code is not None and (m.role == "server" or m.exit_code != 0):
                    what = "SGLang server process" if m.role == "server" else "trainer process"
                    cause = trainer_error(list(m.tail)) if m.role == "trainer" else ""
                    exited = f"{m.where()}: its {what} exited with {_exit_text(m.exit_code)}"
                    # the trainer's own exception last on screen, as the local launcher does
                    raise LaunchError(f"{exited}; last lines of {m.log}:\n{m.last_lines()}"
                                      + (f"\n{m.name} exited with {_exit_text(m.exit_code)}: "
                                         f"{cause}" if cause else ""))
            if all(t.exit_code == 0 for t in trainers):
                return 0
            time.sleep(POLL_INTERVAL)

    def _take(self, m: _Member) -> None:
        import ray

        ref, m.pending = m.pending, None
        try:
            code, chunk = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            m.dead = True
            raise LaunchError(f"{m.where()} died: {_first_line(e)}; last lines of {m.log}:\n"
                              f"{m.last_lines()}") from None
        m.last_answer = time.monotonic()
        if chunk:
            m.offset += len(chunk)
            text = m.decoder.decode(chunk)
            m.log_file = m.log_file or TidyLog(m.log)
            m.log_file.write(text)
            lines = (m.partial + text).split("\n")
            m.partial = lines.pop()  # a line still being written
            m.tail.extend(lines)
            if self.echo and m.name == "trainer_0":
                CONSOLE.feed("trainer", text)
        m.exit_code = code

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every process, copy the last log lines, kill the actors, free the resources."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.echo = False
        CONSOLE.close()
        alive = [m for m in self.members if not m.dead]
        stops = [m.handle.stop.remote(STOP_TIMEOUT / 2) for m in alive]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT)
        for m in alive:  # the log lines written while stopping
            m.pending = m.handle.poll.remote(m.offset) if m.pending is None else m.pending
        if alive:
            ray.wait([m.pending for m in alive], num_returns=len(alive), timeout=10)
        for m in alive:
            if ray.wait([m.pending], timeout=0)[0]:
                with contextlib.suppress(LaunchError):  # died while stopping: killed anyway
                    self._take(m)
        for m in self.members:
            ray.kill(m.handle, no_restart=True)
            if m.log_file is not None:
                m.log_file.close()
        for group in self.groups:
            remove_placement_group(group)
        ray.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3])[:600] if lines else type(e).__name__


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else _first_line(e)


def _exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def launch(target_name: str, argv: list[str]) -> int:
    target = resolve_target(target_name, argv)  # fails fast on a typo
    check_model_path(target.config)
    if target.config.launcher.cpu_allocation == "split":
        CONSOLE.line("[launcher] launcher.cpu_allocation=split is the local launcher's; Ray "
                     "places processes by launcher.cpus_per_server / cpus_per_trainer")
    for key, cpus in (("server.cpus", target.config.server.cpus),
                      ("launcher.trainer_cpus", target.config.launcher.trainer_cpus)):
        if cpus:  # Ray hands out cores itself (launcher.cpus_per_server / cpus_per_trainer)
            raise LaunchError(f"{key}={list(cpus)} pins processes of the local launcher; under "
                              f"Ray use launcher.cpus_per_server / launcher.cpus_per_trainer")
    job = RayJob(target)
    try:
        job.start()
        code = job.watch()
        CONSOLE.line("[launcher] every trainer rank finished")
        return code
    finally:
        job.stop()


def main(argv: Optional[list[str]] = None) -> int:
    return launcher_main(launch, __doc__ or "", argv, "every actor")


if __name__ == "__main__":
    sys.exit(main())
