"""More inference servers for a running Ray job:

    python -m areal_like.launcher.ray_scale <experiment>/<trial> server.n_servers=N \\
        [launcher.ray_address=auto]

The Ray launcher of a job holds a named actor, `ServerCountRequests` (named after the job's
experiment and trial, in the `areal_like` namespace); this command sends it the count wanted.
The launcher takes the request between its polls of the actors: the new servers get a placement
group of their own (`launcher.placement_timeout`, `launcher.placement_strategy`), start as the
first ones did, and their addresses go into the addresses file trainer rank 0's fleet client
reads (`rollout.server_addrs_file`): each joins as `areal-like serve --join` does, checked to
serve the fleet's model and vocabulary and loaded with the current weights before any request.
The run goes on meanwhile; a request the cluster cannot place is refused with the reason and
leaves the job as it was. Lowering the count is not done yet (the launcher owns the addresses
file; draining a server through it is how servers of one's own leave, docs/deployment.md).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, cast

from areal_like.launcher.ray_cluster import check_weight_path, connect, plan, reserve
from areal_like.launcher.ray_member import Member
from areal_like.launcher.target import LaunchError

NAMESPACE = "areal_like"
USAGE = ("usage: python -m areal_like.launcher.ray_scale <experiment>/<trial> "
         "server.n_servers=N [launcher.ray_address=ADDRESS]")


def requests_name(experiment: str, trial: str) -> str:
    return f"server_count:{experiment}/{trial}"


class ServerCountRequests:
    """The running job's inbox for a server count (plain; `ray.remote` wraps it)."""

    def __init__(self, n_servers: int) -> None:
        self.n_servers = n_servers
        self.wanted: Optional[int] = None
        self.answer = ""

    def request(self, n_servers: int) -> dict[str, Any]:
        self.wanted = n_servers
        return {"n_servers": self.n_servers}

    def take(self) -> Optional[int]:
        wanted, self.wanted = self.wanted, None
        return wanted

    def report(self, n_servers: int, answer: str) -> None:
        self.n_servers, self.answer = n_servers, answer

    def status(self) -> dict[str, Any]:
        return {"n_servers": self.n_servers, "pending": self.wanted, "answer": self.answer}


def open_requests(job: Any) -> Any:
    """The job's named inbox; LaunchError when a job of the same experiment and trial runs on
    this cluster already."""
    import ray

    logging = job.config.logging
    name = requests_name(logging.experiment_name, logging.trial_name)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:  # on the launcher's own node: it lives as long as the launcher
        return ray.remote(ServerCountRequests).options(
            name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True),
        ).remote(len(job.servers))
    except ValueError as e:  # the name is taken
        raise LaunchError(f"a job named {logging.experiment_name}/{logging.trial_name} "
                          f"(logging.experiment_name / logging.trial_name) already runs on "
                          f"this Ray cluster: {e}") from None


class ServerCountWatch:
    """The launcher's side: takes a request between polls and adds the servers in the
    background; `poll` hands the started ones to the job."""

    def __init__(self, job: Any, say: Callable[[str], None]) -> None:
        """`job`: the launcher's RayJob (its servers, members, groups, healer thread pool)."""
        self.job, self.say = job, say
        self.inbox = open_requests(job)
        self.pending: Any = None  # the ObjectRef of `take` in flight
        self.adding: Any = None  # the Future of servers being added
        self.inbox_failures = 0

    def poll(self) -> None:
        import ray

        job = self.job
        if self.adding is not None:
            if not self.adding.done():
                return
            adding, self.adding = self.adding, None
            try:
                group, new = adding.result()
            except Exception as e:  # noqa: BLE001 - answered; the running job is left as it was
                self._answer(f"refused: {e if isinstance(e, LaunchError) else repr(e)}")
                return
            job.groups.append(group)
            job.members.extend(new)
            job.servers.extend(new)
            job._write_actors()
            job._try_to_tell_rank0()  # the new addresses: the trainer's client adds them
            self._answer(f"{len(job.servers)} servers: {', '.join(s.address for s in new)} "
                         f"added (each joins once checked and loaded with the current weights)")
            return
        if self.pending is None:
            self.pending = self.inbox.take.remote()
        if not ray.wait([self.pending], timeout=0)[0]:
            return
        try:
            wanted = ray.get(self.pending)
        except ray.exceptions.RayActorError as e:  # being restarted by Ray: asked again later
            if not self.inbox_failures:
                self.say(f"[launcher] the server-count inbox failed ({e.__class__.__name__}); "
                         f"a request sent meanwhile may need sending again")
            self.inbox_failures += 1
            wanted = None
        self.pending = None
        if wanted is None:
            return
        if wanted <= len(job.servers):
            self._answer(f"refused: server.n_servers={wanted} is not above the "
                         f"{len(job.servers)} running (it can only be raised on a running job)")
            return
        self.say(f"[launcher] adding {wanted - len(job.servers)} server(s) "
                              f"(server.n_servers={wanted} asked)")
        self.adding = job.healer.submit(self._add, wanted)

    def _add(self, wanted: int) -> tuple[Any, list[Member]]:
        """Reserve, place and start the new servers (a thread); all or none."""
        import ray
        from ray.util.placement_group import remove_placement_group

        job, config = self.job, self.job.config
        first = len(job.servers)
        bundle = plan(config, 0).server
        group = reserve(f"{job.run_id}_servers_{first}", [bundle] * (wanted - first),
                        config.launcher.placement_strategy, config.launcher.placement_timeout)
        new = [job._spawn("server", first + i, group, bundle, bundle_index=i)
               for i in range(wanted - first)]
        try:
            nodes = job._gather([(m, m.handle.node.remote()) for m in new],
                                config.launcher.placement_timeout, "start")
            for member, node in zip(new, nodes, strict=True):
                member.node = node
            check_weight_path(config, new, job.trainers[0])
            job.start_servers(new)
        except BaseException:
            for m in new:
                ray.kill(m.handle, no_restart=True)
            remove_placement_group(group)
            raise
        return group, new

    def _answer(self, answer: str) -> None:
        self.say(f"[launcher] server count: {answer}")
        self.inbox.report.remote(len(self.job.servers), answer)

    def close(self) -> None:
        import ray

        ray.kill(self.inbox, no_restart=True)


def main(argv: list[str]) -> int:
    """Send the count to the running job; print its answer once it gave one (bounded)."""
    import time

    import ray

    values = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    if len(argv) < 2 or "/" not in argv[0] or "server.n_servers" not in values \
            or set(values) - {"server.n_servers", "launcher.ray_address"}:
        print(USAGE, file=sys.stderr)
        return 2
    experiment, trial = argv[0].split("/", 1)
    try:
        wanted = int(values["server.n_servers"])
    except ValueError:
        print(f"server.n_servers={values['server.n_servers']!r}: not a whole number",
              file=sys.stderr)
        return 2
    connect(values.get("launcher.ray_address", "auto"))
    try:
        inbox = ray.get_actor(requests_name(experiment, trial), namespace=NAMESPACE)
    except ValueError:
        print(f"no running Ray job named {experiment}/{trial} on this cluster "
              f"(logging.experiment_name/logging.trial_name of its launcher)", file=sys.stderr)
        return 1
    before = cast(dict[str, Any], ray.get(inbox.status.remote(), timeout=60))
    ray.get(inbox.request.remote(wanted), timeout=60)
    print(f"asked {experiment}/{trial} for server.n_servers={wanted} "
          f"({before['n_servers']} running)")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the request taken: the launcher answers at once
        status = ray.get(inbox.status.remote(), timeout=60)
        if status["pending"] is None:
            print("taken: the launcher adds the servers while the run goes on "
                  "(its console names them once they joined)" if wanted > before["n_servers"]
                  else status["answer"] or "taken")
            return 0
        time.sleep(0.5)
    print("the launcher has not taken the request within 60 s (is it running?)",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
