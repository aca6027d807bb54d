"""Servers that join and leave a running job through its addresses file
(`rollout.server_addrs_file`, one host:port per line; `areal-like serve --join` and the Ray
launcher write it).

A line added: the server joins out of service and serves once it holds the current weights
(the membership's readmission: a folder load, or the trainer's next update for the
distributed and delta transports). A line removed: the server drains — no new request goes to
it, the requests in flight on it end (after `health.drain_timeout` s the rest are retried on
the others), it leaves the fleet, and `<file>.drained` lists it so that whoever serves it may
stop it. While the client reads the file it keeps `<file>.client.<host>.<pid>` fresh (its
mtime, each read; removed when the client stops): `serve --join` knows from it that a job
reads the file, and that one has ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from areal_like.api.config import RolloutConfig
from engines.fleet.routing import ServerPool

logger = logging.getLogger("engines.fleet.client")
DRAIN_POLL_S = 0.1
HEARTBEAT_GRACE_S = 30.0  # a heartbeat older than this and 5 reads is a client that ended


def heartbeat_path(addrs_file: str | Path) -> Path:
    return Path(f"{addrs_file}.client.{socket.gethostname()}.{os.getpid()}")


def reading_clients(addrs_file: str | Path) -> list[Path]:
    """The heartbeats of the clients that read `addrs_file` now (fresh ones)."""
    path = Path(addrs_file)
    fresh = []
    for beat in path.parent.glob(f"{path.name}.client.*"):
        try:
            interval = float(json.loads(beat.read_text())["interval"])
            age = time.time() - beat.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed meanwhile, or being written
        if age <= max(HEARTBEAT_GRACE_S, 5 * interval):
            fresh.append(beat)
    return fresh


class AddressesFile:
    """The fleet membership's view of the file: `pool` (routing), `counts` (added, drained),
    `lock` (held by weight updates), `awaiting` (servers waiting for the trainer's update)."""

    def __init__(self, config: RolloutConfig, pool: ServerPool, counts: dict[str, int],
                 lock: Callable[[], asyncio.Lock], awaiting: set[str]) -> None:
        self.config, self.pool, self.counts = config, pool, counts
        self.lock, self.awaiting = lock, awaiting
        self.listed: set[str] = set()  # servers the file listed at the last read
        self.draining: dict[str, asyncio.Task[None]] = {}  # removed from it, leaving
        self.unchecked: set[str] = set()  # joined: is it the fleet's model? (see identity.py)
        self._stamp: Optional[tuple[int, int, int]] = None  # mtime_ns, inode, size
        self._heartbeat: Optional[Path] = None

    def read(self) -> None:
        """Join the servers newly listed, drain those no longer listed (on the client's loop)."""
        if not self.config.server_addrs_file:
            return
        path = Path(self.config.server_addrs_file)
        self._beat(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)  # an atomic rewrite: a new inode
        if stamp == self._stamp:
            return
        self._stamp = stamp
        listed = []
        for line in path.read_text().splitlines():
            addr = line.split("#", 1)[0].strip()
            host, _, port = addr.rpartition(":")
            if addr and not (host and port.isdigit()):
                logger.error("%s: %r is not host:port; ignored", path, addr)
            elif addr:
                listed.append(addr)
        for addr in listed:
            if addr not in self.pool.inflight and addr not in self.draining:
                self.pool.add(addr, reason="new: loading the current weights")
                self.unchecked.add(addr)
                self.counts["added"] += 1
                logger.warning("inference server %s added from %s", addr, path)
        for addr in sorted(self.listed - set(listed)):
            if addr in self.pool.inflight and addr not in self.draining:
                self.draining[addr] = asyncio.get_running_loop().create_task(
                    self._drain(addr, path))
        self.listed = set(listed)

    def _beat(self, path: Path) -> None:
        try:
            if self._heartbeat is None:
                beat = heartbeat_path(path)
                beat.write_text(json.dumps({"interval": self.config.health.check_interval}))
                self._heartbeat = beat
            else:
                os.utime(self._heartbeat)
        except OSError as e:  # (a folder removed under a running job: nothing joins then)
            logger.warning("could not mark %s as read (%s)", path, e)
            self._heartbeat = None

    def stop(self) -> None:
        """This client no longer reads the file."""
        if self._heartbeat is not None:
            self._heartbeat.unlink(missing_ok=True)
            self._heartbeat = None

    async def _drain(self, addr: str, path: Path) -> None:
        pool = self.pool
        try:
            pool.take_out(addr, f"draining: removed from {path}")
            self.awaiting.discard(addr)
            self.unchecked.discard(addr)
            logger.warning("inference server %s removed from %s: draining its %d request(s) "
                           "in flight", addr, path, pool.inflight.get(addr, 0))
            timeout = self.config.health.drain_timeout
            deadline = time.monotonic() + timeout
            while pool.inflight.get(addr, 0) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            left = pool.inflight.get(addr, 0)
            async with self.lock():  # not in the middle of an update that names it
                pool.remove(addr)
                self.awaiting.discard(addr)
            self.counts["drained"] += 1
            how = "drained" if not left else (f"{left} request(s) still in flight after "
                                              f"{timeout:.0f} s are retried on the others")
            logger.warning("inference server %s left the fleet (%s; %d of %d in service)", addr,
                           how, len(pool.in_service()), len(pool.addresses))
            with open(f"{path}.drained", "a") as f:
                f.write(f"{addr}\n")
        finally:
            self.draining.pop(addr, None)
            if addr in self.listed:  # listed again while it drained: joins again
                self._stamp = None
