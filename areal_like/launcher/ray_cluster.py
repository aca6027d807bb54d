"""Connecting to an existing Ray cluster and reserving the job's resources with placement groups.

No cluster manager of our own: `ray start --head` (and `ray start --address=...` on other nodes)
makes the cluster; this asks it for bundles and fails with a clear message when it cannot.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_like.launcher.target import LaunchError

START_HINT = ("start one with `ray start --head --port=6379` on the head node (and "
              "`ray start --address=<head ip>:6379` on every other node), then pass "
              "launcher.ray_address=<head ip>:6379 (or leave it 'auto' on a cluster node)")


def _auto_address() -> str:
    """Ray's meaning of 'auto': $RAY_ADDRESS, else the cluster last started on this machine."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if current.is_file() and current.read_text().strip():
        return current.read_text().strip()
    raise LaunchError(f"no Ray cluster found (launcher.ray_address='auto': RAY_ADDRESS is not "
                      f"set and no cluster was started on this machine); {START_HINT}")


def connect(address: str, timeout: float = 10.0) -> str:
    """`ray.init` the cluster at `address` ('auto' or host:port); the address used.

    The head is probed first: `ray.init` on an address nobody listens on retries forever."""
    import ray

    resolved = _auto_address() if address == "auto" else address
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        source = f"launcher.ray_address={address!r}" + (
            f" (resolved to {resolved!r})" if resolved != address else "")
        raise LaunchError(f"no Ray cluster reachable at {source}: {e}; {START_HINT}") from None
    ray.init(address=resolved, logging_level=logging.WARNING, log_to_driver=False,
             namespace="areal_like")
    return resolved


@dataclass
class Allocation:
    """Bundles of the servers' and the trainers' placement groups."""

    server: dict[str, float]
    trainer: dict[str, float]
    n_servers: int
    n_trainers: int


def plan(config: Any, n_servers: int) -> Allocation:
    """Resources per server and per trainer rank, checked against what the cluster has."""
    import ray

    launcher, server = config.launcher, config.server
    cluster = ray.cluster_resources()
    has_gpus = cluster.get("GPU", 0) > 0
    trainer_gpus = launcher.gpus_per_trainer
    if trainer_gpus < 0:  # auto
        trainer_gpus = 1 if has_gpus else 0
    server_bundle = {"CPU": launcher.cpus_per_server}
    if server.device == "cuda":
        server_bundle["GPU"] = server.gpus_per_server
    trainer_bundle = {"CPU": launcher.cpus_per_trainer}
    if trainer_gpus:
        trainer_bundle["GPU"] = trainer_gpus
    n_trainers = launcher.n_trainer_procs
    for resource in ("CPU", "GPU"):
        need = (n_servers * server_bundle.get(resource, 0)
                + n_trainers * trainer_bundle.get(resource, 0))
        if need > cluster.get(resource, 0):
            raise LaunchError(
                f"the job needs {need:g} {resource} ({n_servers} server(s) x "
                f"{server_bundle.get(resource, 0):g} + {n_trainers} trainer rank(s) x "
                f"{trainer_bundle.get(resource, 0):g}: server.n_servers, "
                f"launcher.cpus_per_server / server.gpus_per_server, launcher.n_trainer_procs, "
                f"launcher.cpus_per_trainer / launcher.gpus_per_trainer) but the Ray cluster has "
                f"{cluster.get(resource, 0):g} {resource} in all")
    return Allocation(server_bundle, trainer_bundle, n_servers, n_trainers)


def reserve(name: str, bundles: list[dict[str, float]], strategy: str, timeout: float) -> Any:
    """A ready placement group (LaunchError when the cluster cannot grant it in `timeout`)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise LaunchError(
            f"Ray could not place {name} ({len(bundles)} x {bundles[0]}, strategy {strategy}) "
            f"within launcher.placement_timeout={timeout:g} s; free now: "
            f"{ray.available_resources()}") from None
    return group


def check_weight_path(config: Any, servers: list[Any], rank0: Any) -> None:
    """The disk and delta weight transports need every server on trainer rank 0's node, or a
    shared run directory (`servers`, `rank0`: launcher members with the `node` Ray placed
    them on)."""
    transport = config.rollout.weights.transport
    if transport not in ("disk", "delta") or config.launcher.shared_dir:
        return
    away = [s.where() for s in servers if s.node["node_id"] != rank0.node["node_id"]]
    if away:
        raise LaunchError(
            f"{', '.join(away)} {'is' if len(away) == 1 else 'are'} not on the node of "
            f"{rank0.where()}, so cannot read the weights it writes to disk "
            f"(rollout.weights.transport={transport}): set "
            f"rollout.weights.transport=distributed, or launcher.shared_dir=<a folder every "
            f"node mounts at the same path>")
