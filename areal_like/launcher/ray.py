"""Ray launcher: the SGLang servers and the trainer ranks as actors on an existing Ray cluster.

    python -m areal_like.launcher.ray <recipe> [--config FILE] [key=value ...]
    python -m areal_like.launcher.ray path/to/train.py --config FILE [key=value ...]

Connects to `launcher.ray_address` ('auto' by default), reserves one placement group for the
servers (`server.n_servers` x `launcher.cpus_per_server` CPUs, `server.gpus_per_server` GPUs on
CUDA) and one for the trainer ranks (`launcher.n_trainer_procs` x `launcher.cpus_per_trainer`
CPUs, `launcher.gpus_per_trainer` GPUs), starts each server on its node's address and then the
trainer ranks as one torch.distributed job (rank 0's node hosts the rendezvous). Weights reach the
servers by `rollout.weights.transport`: `distributed` always works across nodes; `disk` needs the
servers on trainer rank 0's node or `launcher.shared_dir`. Logs of every actor are copied to
`<run dir>/logs/`.

What fails is brought back by Ray: a server whose actor or process dies is restarted by Ray in
its bundle (`server.max_restarts` times) and rejoins the trainer's fleet with the current
weights; a trainer rank (or its node) that dies stops the whole trainer gang, which starts
again from the last checkpoint (`launcher.max_trainer_restarts` times; 0 by default) while the
fleet is kept. Bundles of a lost node are placed again by Ray where resources allow. Past a
bound, or when Ray cannot place a bundle within `launcher.placement_timeout`, the job stops
naming the actor, its node and its last log lines; every process is stopped on the way out
(Ctrl-C, SIGTERM and `ray job stop` too).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from areal_like.launcher.console import Console, TidyLog
from areal_like.launcher.ray_actors import ProcessLost
from areal_like.launcher.ray_cluster import check_weight_path, connect, plan, reserve
from areal_like.launcher.ray_member import Member, cause, exit_text, first_line, trainer_env
from areal_like.launcher.ray_scale import ServerCountWatch
from areal_like.launcher.target import (
    LaunchError,
    TrainTarget,
    check_model_path,
    launcher_main,
    resolve_target,
    trainer_error,
)
from areal_like.utils.atomic_file import write_atomic
from areal_like.utils.metrics_logger import run_dir

POLL_INTERVAL = 0.5
STOP_TIMEOUT = 30.0
AWAIT_CALL_S = 10.0
CONSOLE = Console()


def _replace_overrides(overrides: list[str], extra: list[str]) -> list[str]:
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + extra


class RayJob:
    def __init__(self, target: TrainTarget) -> None:
        self.target, self.config = target, target.config
        self.members: list[Member] = []
        self.servers: list[Member] = []
        self.trainers: list[Member] = []
        self.groups: list[Any] = []
        self.log_dir = run_dir(self.config.logging) / "logs"
        self.echo = True
        self.trainer_restarts = 0
        self.healer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ray-heal")
        self.actors_lock = threading.Lock()
        self.scaling: Optional[ServerCountWatch] = None  # `server.n_servers` raised as it runs

    @property
    def node_dir(self) -> str:
        """The job's folder on every node (actor logs, what the launcher tells rank 0)."""
        return f"/tmp/areal_like_ray/{self.run_id}"

    # -- start ---------------------------------------------------------------------------------
    def _spawn(self, role: str, index: int, group: Any, bundle: dict[str, float],
               bundle_index: Optional[int] = None) -> Member:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal_like.launcher.ray_actors import ProcessActor

        name = f"{role}_{index}"
        # Ray restarts a dead actor in its bundle (rescheduled onto another node when its node
        # is lost); the driver then starts its process again. Unbounded for Ray: the launcher
        # counts restarts (server.max_restarts, launcher.max_trainer_restarts), while Ray's own
        # count is also spent by a restart tried on a node not yet declared dead
        handle = ray.remote(ProcessActor).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            max_restarts=-1, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index if bundle_index is None
                else bundle_index),
        ).remote(name, os.getcwd(), self.node_dir)
        return Member(name, role, handle, self.log_dir / f"{name}.log", bundle)

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
        if alloc.n_servers:
            self.groups.append(reserve(f"{self.run_id}_servers", [alloc.server] * alloc.n_servers,
                                       launcher.placement_strategy, launcher.placement_timeout))
            self.servers = [self._spawn("server", i, self.groups[-1], alloc.server)
                            for i in range(alloc.n_servers)]
            self.members.extend(self.servers)
        self.groups.append(reserve(f"{self.run_id}_trainers", [alloc.trainer] * alloc.n_trainers,
                                   launcher.placement_strategy, launcher.placement_timeout))
        self.trainers = [self._spawn("trainer", r, self.groups[-1], alloc.trainer)
                         for r in range(alloc.n_trainers)]
        self.members.extend(self.trainers)
        nodes = self._gather([(m, m.handle.node.remote()) for m in self.members],
                             launcher.placement_timeout, "start")
        for member, node in zip(self.members, nodes, strict=True):
            member.node = node
        check_weight_path(self.config, self.servers, self.trainers[0])
        if launcher.master_port:  # a fixed port in use is named before any server starts
            self._reserve_rendezvous_port()
        if self.servers:
            CONSOLE.line(f"[launcher] starting {len(self.servers)} {config.server.backend} "
                         f"server(s) on {config.model.path}")
            self.start_servers(self.servers)
            CONSOLE.line(f"[launcher] servers ready: {[s.address for s in self.servers]}")
            self.scaling = ServerCountWatch(self, CONSOLE.line)
            CONSOLE.line(f"[launcher] more servers while it runs: python -m "
                         f"areal_like.launcher.ray_scale {config.logging.experiment_name}/"
                         f"{config.logging.trial_name} server.n_servers=N")
        self._start_trainers()

    def start_servers(self, servers: list[Member]) -> None:
        """Each member's server started on its node's address; its address and pid noted."""
        config = self.config
        addrs = self._gather([(s, s.handle.start_server.remote(
            config.model.path, config.server, config.rollout.client.api_key))
            for s in servers], config.server.startup_timeout + 60, "start its server")
        for s, addr in zip(servers, addrs, strict=True):
            s.address = addr
            s.pid = self._gather([(s, s.handle.child_pids.remote())], 60,
                                 "report its pid")[0][0]

    def _start_trainers(self) -> None:
        """Start every trainer rank as one torch.distributed job (after a restart: resuming
        from the last checkpoint, with the fleet's current addresses)."""
        config, rank0 = self.config, self.trainers[0]
        check_weight_path(config, self.servers, rank0)
        port = self._reserve_rendezvous_port()
        extra = []
        if self.servers:
            extra += [f"rollout.server_addrs=[{','.join(s.address for s in self.servers)}]",
                      f"rollout.server_addrs_file={self.node_dir}/server_addrs.txt"]
        if config.rollout.weights.transport == "distributed":
            extra.append(f"rollout.weights.group_addr={rank0.node['ip']}")
        if self.trainer_restarts:
            extra.append("checkpoint.recover=auto")
        self._tell_rank0()
        argv = [*self.target.entry, "--config", str(self.target.config_path),
                *_replace_overrides(self.target.overrides, extra)]
        CONSOLE.line(f"[launcher] {len(self.trainers)} trainer rank(s), rendezvous "
                     f"{rank0.node['ip']}:{port}: python {' '.join(argv)}")
        pids = self._gather([(t, t.handle.start_process.remote(
            [sys.executable, *argv], trainer_env(
                self.config, self.trainers, t, r, rank0.node["ip"], port, self.node_dir,
                self.trainer_restarts, CONSOLE.tty)))
            for r, t in enumerate(self.trainers)], 60, "start its trainer")
        for t, pid in zip(self.trainers, pids, strict=True):
            t.pid, t.last_answer = pid, time.monotonic()
        self._write_actors()

    def _reserve_rendezvous_port(self) -> int:
        """`launcher.master_port` if free on rank 0's node (0: a free one); else LaunchError."""
        rank0 = self.trainers[0]
        return self._gather([(rank0, rank0.handle.rendezvous_port.remote(
            self.config.launcher.master_port))], 60, "reserve the rendezvous port")[0]

    def _tell_rank0(self) -> None:
        """Write the restart counts and the servers' addresses on trainer rank 0's node,
        where its metrics and its fleet client read them."""
        rank0 = self.trainers[0]
        counts = {"server_restarts": sum(s.restarts for s in self.servers),
                  "trainer_restarts": self.trainer_restarts}
        calls = [(rank0, rank0.handle.write_text.remote(f"{self.node_dir}/launcher_state.json",
                                                        json.dumps(counts)))]
        if self.servers:
            calls.append((rank0, rank0.handle.write_text.remote(
                f"{self.node_dir}/server_addrs.txt",
                "".join(f"{s.address}\n" for s in self.servers))))
        self._gather(calls, 60, "write what the launcher tells rank 0")

    def _write_actors(self) -> None:
        with self.actors_lock:  # server restarts write it from their threads
            write_atomic(self.log_dir / "actors.json",
                         json.dumps([m.record() for m in self.members], indent=1))

    def _gather(self, calls: list[tuple[Member, Any]], timeout: float, what: str) -> list[Any]:
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
                                  f"{first_line(e)}") from None
            except Exception as e:  # the actor's own error, e.g. a server that did not start
                raise LaunchError(f"{member.where()} failed to {what}: {cause(e)}") from None
        return out

    # -- run -----------------------------------------------------------------------------------
    def watch(self) -> int:
        """Stream logs until every trainer rank exits; bring back what fails while restarts
        are left; 0, or LaunchError once something fails past its bound."""
        import ray

        unresponsive = self.config.launcher.actor_unresponsive_timeout
        while True:
            live = [m for m in self.members if m.healing is None and not m.failure]
            for m in live:
                if m.pending is None:
                    m.pending = m.handle.poll.remote(m.offset)
            pending = [m.pending for m in live]
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_INTERVAL)
            for m in live:
                if m.pending in ready:
                    self._take(m)
                elif time.monotonic() - m.last_answer > unresponsive:
                    m.failure = (f"has not answered for {unresponsive:g} s "
                                 f"(launcher.actor_unresponsive_timeout)")
            for s in self.servers:
                self._heal_server(s)
            if self.scaling is not None:
                self.scaling.poll()
            failed = [t for t in self.trainers if t.failure or t.exit_code not in (None, 0)]
            if failed:
                self._restart_trainers(failed[0])
            elif all(t.exit_code == 0 for t in self.trainers):
                return 0
            time.sleep(POLL_INTERVAL)

    def _take(self, m: Member) -> None:
        import ray

        ref, m.pending = m.pending, None
        try:
            code, chunk = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            m.dead, m.failure = True, f"died: {first_line(e)}"
            return
        except ProcessLost as e:  # Ray already restarted it: dead to the launcher all the same
            m.dead, m.failure = True, f"died: {cause(e)}"
            return
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
        if code is not None and m.role == "server":
            m.failure = (f"its {self.config.server.backend} server process exited with "
                         f"{exit_text(code)}")

    # -- heal ----------------------------------------------------------------------------------
    def _heal_server(self, s: Member) -> None:
        """Start restarting a failed server (in the background: the run goes on with the
        others), report one that came back, or stop the job past `server.max_restarts`."""
        if s.healing is not None:
            if s.healing.done():
                s.healing, back = None, s.healing.result()  # LaunchError if it failed
                CONSOLE.line(f"[launcher] {back}")
            return
        if not s.failure:
            return
        limit = self.config.server.max_restarts
        if s.restarts >= limit:
            used = (f" (its {limit} restart(s), server.max_restarts, are used up)" if limit
                    else "")
            raise LaunchError(f"{s.where()} {s.failure}{used}; last lines of {s.log}:\n"
                              f"{s.last_lines()}")
        s.restarts += 1
        CONSOLE.line(f"[launcher] {s.where()} {s.failure}; restarting it (restart {s.restarts} "
                     f"of {limit}, server.max_restarts); last lines of {s.log}:\n"
                     f"{s.last_lines(5)}")
        s.healing = self.healer.submit(self._restart_server, s, time.monotonic())

    def _restart_server(self, s: Member, failed_at: float) -> str:
        """Ray restarts the actor (killed first if it is alive: a dead server process or a
        hung actor), in its bundle; the server starts again, on its old address if it can."""
        import ray

        self._try_to_tell_rank0()  # the count of restarts begun
        old_pid = None
        if not s.dead:
            old_pid = s.node.get("actor_pid")
            ray.kill(s.handle, no_restart=False)
        self._await_actor(s, old_pid)
        config = self.config
        s.address = self._gather([(s, s.handle.start_server.remote(
            config.model.path, config.server, config.rollout.client.api_key, s.address))],
            config.server.startup_timeout + 60, "restart its server")[0]
        s.pid = self._gather([(s, s.handle.child_pids.remote())], 60, "report its pid")[0][0]
        s.failure, s.last_answer = "", time.monotonic()  # silent while it restarted
        self._write_actors()
        self._try_to_tell_rank0()  # a new address joins the trainer's client through the file
        return (f"{s.where()} is serving again at {s.address}, "
                f"{time.monotonic() - failed_at:.1f} s after its failure was seen")

    def _try_to_tell_rank0(self) -> None:
        try:
            self._tell_rank0()
        except LaunchError as e:  # rank 0 is being restarted: it is told at its start
            CONSOLE.line(f"[launcher] {e}")

    def _await_actor(self, m: Member, old_pid: Optional[int] = None) -> None:
        """Until Ray has the actor back (restarted in its bundle, which Ray moves to another
        node when its node is lost; a new process when `old_pid` was killed); LaunchError
        naming the node and the bundle if it cannot within `launcher.placement_timeout`."""
        import ray

        timeout = self.config.launcher.placement_timeout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(
                    f"Ray did not bring back {m.where()} within launcher.placement_timeout="
                    f"{timeout:g} s: its bundle {m.bundle} could not be placed again (free "
                    f"now: {ray.available_resources()}, alive nodes: "
                    f"{sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])})")
            try:  # a short call, sent again: one sent while Ray restarts the actor may be lost
                node = ray.get(m.handle.node.remote(), timeout=min(left, AWAIT_CALL_S))
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.ActorUnavailableError:  # restarting
                time.sleep(POLL_INTERVAL)
            except ray.exceptions.RayActorError as e:
                raise LaunchError(f"Ray could not restart {m.where()}: {first_line(e)}") from None
            else:
                if node["actor_pid"] != old_pid:
                    break
                time.sleep(POLL_INTERVAL)  # the killed actor answered before it went
        m.node, m.dead = node, False
        m.new_process()

    def _restart_trainers(self, first: Member) -> None:
        """Stop the trainer gang and start it again from the last checkpoint (the fleet is
        kept: the recovered trainer loads the checkpoint's weights on it), or stop the job
        past `launcher.max_trainer_restarts`."""
        import ray

        limit = self.config.launcher.max_trainer_restarts
        exited = exit_text(first.exit_code) if first.exit_code is not None else ""
        why = first.failure or f"its trainer process exited with {exited}"
        error = trainer_error(list(first.tail)) if exited else ""
        if self.trainer_restarts >= limit:
            used = (f" (its {limit} restart(s), launcher.max_trainer_restarts, are used up)"
                    if limit else "")
            # the trainer's own exception last on screen, as the local launcher does
            raise LaunchError(f"{first.where()}: {why}{used}; last lines of {first.log}:\n"
                              f"{first.last_lines()}"
                              + (f"\n{first.name} exited with {exited}: {error}"
                                 if error else ""))
        self.trainer_restarts += 1
        failed_at = time.monotonic()
        CONSOLE.line(f"[launcher] {first.where()}: {why}" + (f" ({error})" if error else "")
                     + f"; restarting the {len(self.trainers)} trainer rank(s) from the last "
                     f"checkpoint (restart {self.trainer_restarts} of {limit}, "
                     f"launcher.max_trainer_restarts)")
        # every rank, whatever is known of its actor (a stop to a dead one just fails); an
        # actor on a lost node Ray has not noticed yet does not answer: bounded
        stops = [t.handle.stop.remote(STOP_TIMEOUT / 2) for t in self.trainers]
        ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT)
        self._drain([t for t in self.trainers if not t.dead])
        hung = {t.name: t.node.get("actor_pid") for t in self.trainers
                if not t.dead and t.failure.startswith("has not answered")}
        for t in self.trainers:
            if t.name in hung:  # alive but hung: Ray restarts it once killed
                ray.kill(t.handle, no_restart=False)
        for t in self.trainers:
            self._await_actor(t, hung.get(t.name))  # those that died are restarted by Ray
            t.failure = ""
            t.restarts += 1
        self._settle_fleet()
        self._start_trainers()
        CONSOLE.line(f"[launcher] trainer gang started again, {time.monotonic() - failed_at:.1f} s "
                     f"after the failure was seen (it resumes from its checkpoint)")

    def _settle_fleet(self) -> None:
        """Before trainers start: every server answers, or is restarted and waited for (a
        new trainer waits for each server it is given; a node lost with a trainer rank may
        have held a server too)."""
        import ray

        for s in self.servers:
            if s.healing is None and not s.failure:
                s.pending = s.pending or s.handle.poll.remote(s.offset)
                if ray.wait([s.pending], timeout=AWAIT_CALL_S)[0]:
                    self._take(s)
                else:
                    s.failure = f"has not answered for {AWAIT_CALL_S:g} s"
            self._heal_server(s)
        for s in self.servers:
            if s.healing is not None:
                s.healing.result()  # bounded by the restart's own timeouts
                self._heal_server(s)

    # -- stop ----------------------------------------------------------------------------------
    def _drain(self, members: list[Member], timeout: float = 10.0) -> None:
        """Copy the log lines the members wrote last (while stopping)."""
        import ray

        members = [m for m in members if not m.dead and m.healing is None]
        for m in members:
            m.pending = m.handle.poll.remote(m.offset) if m.pending is None else m.pending
        if members:
            ray.wait([m.pending for m in members], num_returns=len(members), timeout=timeout)
        for m in members:
            if ray.wait([m.pending], timeout=0)[0]:
                self._take(m)  # one that died while stopping is killed anyway

    def stop(self) -> None:
        """Stop every process, copy the last log lines, kill the actors, free the resources."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.echo = False
        CONSOLE.close()
        # a restart in flight ends when its actor is killed below (its thread's calls fail)
        alive = [m for m in self.members if not m.dead]
        stops = [m.handle.stop.remote(STOP_TIMEOUT / 2) for m in alive]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT)
        self._drain(alive)
        for m in self.members:
            ray.kill(m.handle, no_restart=True)
            if m.log_file is not None:
                m.log_file.close()
        if self.scaling is not None:
            self.scaling.close()
        # servers still being added end with this driver (Ray's actors and groups of a job)
        self.healer.shutdown(wait=False, cancel_futures=True)
        for group in self.groups:
            remove_placement_group(group)
        ray.shutdown()


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
