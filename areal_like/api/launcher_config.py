"""The `launcher` section: how the local and Ray launchers place the trainer and servers
(its own module: `config.py` composes it into every recipe's config)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List

from areal_like.api.config_checks import check as _check
from areal_like.api.config_checks import cpu_list as _cpu_list
from areal_like.api.config_checks import one_of as _one_of

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RANK_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT"})


@dataclass
class LauncherConfig:
    """How a launcher allocates the machines: servers x trainer processes. The `ray_*` keys,
    `*_per_server`/`*_per_trainer` resources and `shared_dir` are read by the Ray launcher."""

    n_trainer_procs: int = 1
    threads_per_trainer: int = 1
    # Local launcher: "split" gives the trainer ranks n_trainer_procs x threads_per_trainer
    # cores of their own (the last ones) and the servers and rollout controller the rest, as
    # GPUs are split on a GPU machine; "shared": every process may run on every core
    cpu_allocation: str = "shared"
    # CPU ids the trainer ranks run on (local launcher); empty: any (see server.cpus)
    trainer_cpus: List[int] = field(default_factory=list)
    master_port: int = 0  # the trainers' rendezvous port on rank 0's node; 0: a free one
    ray_address: str = "auto"  # an existing Ray cluster (`ray start --head` first)
    placement_strategy: str = "PACK"  # of the servers' and of the trainers' placement groups
    cpus_per_server: float = 1.0
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: int = -1  # -1: one GPU per trainer rank where the cluster has GPUs
    # A folder every node mounts at the same path: the run directory goes there so the disk
    # weight transport reaches servers on other nodes (empty: servers must share the node of
    # trainer rank 0, or use rollout.weights.transport=distributed).
    shared_dir: str = ""
    placement_timeout: float = 300.0  # seconds for the cluster to grant the resources
    actor_unresponsive_timeout: float = 60.0  # an actor silent this long counts as dead
    # Ray launcher: times a failed trainer gang (a rank or its node died, or a rank exited
    # non-zero) is restarted from the last checkpoint; 0: the job stops (servers:
    # server.max_restarts)
    max_trainer_restarts: int = 0
    # Environment variables for every trainer rank, both launchers (Ray actors do not see the
    # driver's environment): `launcher.trainer_env.HF_HOME=/data/hf`
    trainer_env: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = "LauncherConfig"
        _check(name, "n_trainer_procs", self.n_trainer_procs >= 1, self.n_trainer_procs, ">= 1")
        _check(name, "threads_per_trainer", self.threads_per_trainer >= 1,
               self.threads_per_trainer, ">= 1")
        _one_of(name, "cpu_allocation", self.cpu_allocation, ("shared", "split"))
        _cpu_list(name, "trainer_cpus", self.trainer_cpus)
        _check(name, "master_port", 0 <= self.master_port <= 65535, self.master_port,
               "a port (1..65535), or 0 for a free one")
        _check(name, "ray_address", bool(self.ray_address.strip()), self.ray_address,
               "'auto' or host:port of the Ray head")
        _one_of(name, "placement_strategy", self.placement_strategy,
                ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
        _check(name, "cpus_per_server", self.cpus_per_server > 0, self.cpus_per_server, "> 0")
        _check(name, "cpus_per_trainer", self.cpus_per_trainer > 0, self.cpus_per_trainer,
               "> 0")
        bad = sorted(k for k in self.trainer_env if not _ENV_NAME.match(str(k)) or k in _RANK_ENV)
        _check(name, "trainer_env", not bad, dict(self.trainer_env),
               f"environment variable names other than {sorted(_RANK_ENV)} (the launcher "
               f"sets those); refused: {bad}")
        self.trainer_env = {str(k): str(v) for k, v in self.trainer_env.items()}
        _check(name, "gpus_per_trainer", self.gpus_per_trainer >= -1, self.gpus_per_trainer,
               ">= 0, or -1 for auto")
        _check(name, "placement_timeout", self.placement_timeout > 0, self.placement_timeout,
               "> 0 seconds")
        _check(name, "max_trainer_restarts", self.max_trainer_restarts >= 0,
               self.max_trainer_restarts, ">= 0")
        _check(name, "actor_unresponsive_timeout", self.actor_unresponsive_timeout > 0,
               self.actor_unresponsive_timeout, "> 0 seconds")
