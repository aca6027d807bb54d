"""The `launcher` section: how the local and Ray launchers place the trainer and servers
(its own module: `config.py` composes it into every recipe's config)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List

from areal_like.api.config_checks import (
    Bound,
    above,
    at_least,
    bounded,
    check_bounds,
    choices,
    cpu_ids,
)
from areal_like.api.config_checks import check as _check

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RANK_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT"})


@dataclass
class SlurmConfig:
    """The Slurm launcher (`python -m areal_like.launcher.slurm`): what it asks `sbatch` for
    and how it places the servers and trainer ranks on the allocation's nodes."""

    nodes: int = bounded(1, bound=at_least(1))
    # nodes that run the inference servers (the first ones); 0: none of their own (with one
    # node, or to share), else the trainer gets the rest
    server_nodes: int = bounded(0, bound=at_least(0))
    partition: str = ""
    account: str = ""
    time_limit: str = ""  # sbatch --time (e.g. 04:00:00); "": the partition's default
    cpus_per_task: int = bounded(1, bound=at_least(1))  # per node: servers and ranks share them
    gpus_per_node: int = bounded(0, bound=at_least(0))
    sbatch_args: List[str] = field(default_factory=list)  # more `#SBATCH` options, as written
    # a failed trainer (or fleet) requeues the job this many times; it resumes from its last
    # checkpoint (checkpoint.recover=auto). 0: a failure ends the job
    max_requeues: int = bounded(0, bound=at_least(0))
    # submit and follow the job until it ends (its exit code is the launcher's); false:
    # submit, print the job id and where its logs go, and return
    wait: bool = True

    def __post_init__(self) -> None:
        check_bounds(self, "SlurmConfig")
        _check("SlurmConfig", "server_nodes", self.server_nodes < self.nodes, self.server_nodes,
               f"fewer than nodes={self.nodes} (the trainer ranks need a node)")


@dataclass
class LauncherConfig:
    """How a launcher allocates the machines: servers x trainer processes. The `ray_*` keys,
    `*_per_server`/`*_per_trainer` resources and `shared_dir` are read by the Ray launcher."""

    n_trainer_procs: int = bounded(1, bound=at_least(1))
    threads_per_trainer: int = bounded(1, bound=at_least(1))
    # Local launcher: "split" gives the trainer ranks n_trainer_procs x threads_per_trainer
    # cores of their own (the last ones) and the servers and rollout controller the rest, as
    # GPUs are split on a GPU machine; "shared": every process may run on every core
    cpu_allocation: str = bounded("shared", bound=choices("shared", "split"))
    # CPU ids the trainer ranks run on (local launcher); empty: any (see server.cpus)
    trainer_cpus: List[int] = bounded(default_factory=list, bound=cpu_ids())
    # the trainers' rendezvous port on rank 0's node; 0: a free one
    master_port: int = bounded(0, bound=Bound("a port (1..65535), or 0 for a free one",
                                              lambda v: 0 <= v <= 65535))
    # an existing Ray cluster (`ray start --head` first)
    ray_address: str = bounded("auto", bound=Bound("'auto' or host:port of the Ray head",
                                                   lambda v: bool(v.strip())))
    # of the servers' and of the trainers' placement groups
    placement_strategy: str = bounded("PACK", bound=choices("PACK", "SPREAD", "STRICT_PACK",
                                                            "STRICT_SPREAD"))
    cpus_per_server: float = bounded(1.0, bound=above(0))
    cpus_per_trainer: float = bounded(1.0, bound=above(0))
    # -1: one GPU per trainer rank where the cluster has GPUs
    gpus_per_trainer: int = bounded(-1, bound=at_least(-1, " (0 or more, or -1 for auto)"))
    # A folder every node mounts at the same path: the run directory goes there so the disk
    # weight transport reaches servers on other nodes (empty: servers must share the node of
    # trainer rank 0, or use rollout.weights.transport=distributed).
    shared_dir: str = ""
    # seconds for the cluster to grant the resources
    placement_timeout: float = bounded(300.0, bound=above(0, " seconds"))
    # an actor silent this long counts as dead
    actor_unresponsive_timeout: float = bounded(60.0, bound=above(0, " seconds"))
    # Ray launcher: times a failed trainer gang (a rank or its node died, or a rank exited
    # non-zero) is restarted from the last checkpoint; 0: the job stops (servers:
    # server.max_restarts)
    max_trainer_restarts: int = bounded(0, bound=at_least(0))
    # Environment variables for every trainer rank, both launchers (Ray actors do not see the
    # driver's environment): `launcher.trainer_env.HF_HOME=/data/hf`
    trainer_env: Dict[str, str] = field(default_factory=dict)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        name = "LauncherConfig"
        check_bounds(self, name)
        bad = sorted(k for k in self.trainer_env if not _ENV_NAME.match(str(k)) or k in _RANK_ENV)
        _check(name, "trainer_env", not bad, dict(self.trainer_env),
               f"environment variable names other than {sorted(_RANK_ENV)} (the launcher "
               f"sets those); refused: {bad}")
        self.trainer_env = {str(k): str(v) for k, v in self.trainer_env.items()}
