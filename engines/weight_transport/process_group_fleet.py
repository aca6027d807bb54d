"""The fleet's end of the distributed weight transport: each server's weight-update group
with trainer rank 0, and the HTTP calls that make the servers receive a broadcast.

One process group per server (trainer = rank 0, the server's tensor-parallel workers the
others), all meeting at one TCP store the trainer hosts. Per-server groups keep failures
apart: a server that dies mid-broadcast breaks only its own group, so the others receive
every bucket and finish the update; a server that joins later (restarted, added) forms its
own group without disturbing the rest.

Runs on trainer rank 0, on the loop of its `FleetUpdater` (engines/fleet/updater.py), which
`areal_like.runtime.weight_broadcast` drives: form -> join -> begin -> receive each bucket ->
end. The fleet's client holds the fleet for the update meanwhile (no server is readmitted
halfway through a broadcast) and names the servers (`FleetView`). A server that fails any step
is dropped from the broadcast; the client then takes it out of service (paused: it may hold
partial weights) until a later broadcast includes it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp

from areal_like.api.config import RolloutConfig
from areal_like.api.io_struct import (
    FleetView,
    WeightGroupLayout,
    WeightGroupSpec,
    WeightUpdateMeta,
)
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError

logger = logging.getLogger("engines.fleet.client")

PROBE_TIMEOUT_S = 10.0


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


class FleetWeightGroup:
    def __init__(self, config: RolloutConfig,
                 session: Callable[[], aiohttp.ClientSession], api: ServerAPI) -> None:
        self.config = config
        self.api = api
        self._session = session
        self.groups: dict[str, str] = {}  # server -> name of its joined group
        self._joining: dict[str, tuple[str, asyncio.Task[Any]]] = {}
        self.failed: dict[str, str] = {}  # servers dropped from the current broadcast, why
        self._members: tuple[str, ...] = ()

    # ---- forming ------------------------------------------------------------------------
    async def form(self, spec: WeightGroupSpec, view: FleetView,
                   force: bool = False) -> WeightGroupLayout:
        """Decide which servers receive the broadcast (those in service in `view`, and those
        awaiting one that answer) and ask those without a group (new, restarted, or all with
        `force`) to join one at `spec` (returns at once: `join` waits)."""
        awaiting = set(view.awaiting_broadcast)
        waiting = [a for a in sorted(awaiting)
                   if not await self.api.answers(self._session(), a, PROBE_TIMEOUT_S)]
        wanted = tuple(sorted(set(view.in_service) | set(waiting)))
        if not wanted:
            raise InferenceServerError("no inference server in service or waiting for weights to "
                                       f"broadcast to; out of service: {view.out_of_service}")
        for addr in [a for a in self.groups if a not in wanted]:
            await self._leave(addr)
        # a restarted server answers at its old address but left its group with its process
        new = [a for a in wanted if force or a not in self.groups or a in awaiting]
        for addr in new:
            await self._leave(addr)
        session = self._session()
        sizes = await asyncio.gather(*(self.api.tp_size(session, a) for a in new),
                                     return_exceptions=True)
        joining = []
        for addr, size in zip(new, sizes, strict=True):
            if isinstance(size, BaseException):
                self.failed[addr] = f"could not be asked for its tensor-parallel size: " \
                                    f"{_describe(size)}"
                continue
            name = f"{spec.group_name}_{addr.replace(':', '_').replace('.', '_')}"
            world_size = 1 + int(size)
            body = {"master_address": spec.master_addr, "master_port": spec.master_port,
                    "rank_offset": 1, "world_size": world_size, "group_name": name,
                    "backend": spec.backend}
            task = asyncio.get_running_loop().create_task(
                self.api.join_group(session, addr, body, spec.timeout_s + 30))
            self._joining[addr] = (name, task)
            joining.append((addr, name, world_size))
        if joining:
            logger.info("inference servers joining weight-update groups (%s): %s", spec.backend,
                        ", ".join(a for a, _, _ in joining))
        members = tuple(a for a in wanted if a not in self.failed)
        return WeightGroupLayout(members=members, joining=tuple(joining))

    async def join(self) -> dict[str, str]:
        """Wait for the servers asked to join; returns those that failed, and why."""
        pending, self._joining = self._joining, {}
        results = await asyncio.gather(*(task for _, task in pending.values()),
                                       return_exceptions=True)
        for (addr, (name, _)), result in zip(pending.items(), results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                self.failed[addr] = f"failed to join the weight-update group: " \
                                    f"{_describe(result)}"
            else:
                self.groups[addr] = name
        return dict(self.failed)

    async def _leave(self, addr: str) -> None:
        """`addr` leaves its group (best effort: a dead or stuck server is left behind)."""
        name = self.groups.pop(addr, None)
        if name is None:
            return
        try:
            await self.api.leave_group(self._session(), addr, name)
        except Exception as e:  # noqa: BLE001
            logger.info("inference server %s: leaving weight-update group %s: %s", addr, name, e)

    async def dissolve(self) -> None:
        for addr in list(self.groups):
            await self._leave(addr)

    # ---- one broadcast ------------------------------------------------------------------
    async def _each(self, members: tuple[str, ...],
                    call: Callable[[str], Any]) -> dict[str, str]:
        results = await asyncio.gather(*(call(a) for a in members), return_exceptions=True)
        failures = {}
        for addr, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation
                failures[addr] = _describe(result)
        self.failed.update(failures)
        return failures

    async def begin(self, meta: WeightUpdateMeta) -> tuple[str, ...]:
        """Pause the members that joined; returns those that will receive the broadcast."""
        members = tuple(a for a in self.groups if a not in self.failed)
        session = self._session()

        async def begin_one(addr: str) -> None:
            await self.api.pause(session, addr, "retract")
            try:
                await self.api.begin_group_update(session, addr)
            except InferenceServerError as refused:
                # A broadcast that dropped this server (or a trainer killed mid-broadcast)
                # left its session open; SGLang refuses a second one until it is ended.
                # Still paused: the partial weights it ends with are replaced by this one.
                try:
                    await self.api.end_group_update(session, addr)
                except InferenceServerError:
                    raise refused from None  # no session was open: the refusal is the fault
                logger.warning("inference server %s: %s; ended the session an earlier broadcast "
                               "left open, beginning again", addr, refused)
                await self.api.begin_group_update(session, addr)

        failures = await self._each(members, begin_one)
        self._members = tuple(a for a in members if a not in failures)
        return self._members

    async def receive(self, meta: WeightUpdateMeta, index: int,
                      members: tuple[str, ...]) -> dict[str, str]:
        """Each of `members` receives bucket `index` on its group; returns those that
        failed, and why."""
        bucket = meta.buckets[index]
        last = index == len(meta.buckets) - 1
        session = self._session()

        def post(addr: str) -> Any:
            body = {"names": [p.name for p in bucket], "dtypes": [p.dtype for p in bucket],
                    "shapes": [list(p.shape) for p in bucket], "group_name": self.groups[addr],
                    "flush_cache": last, "weight_version": str(meta.version) if last else None}
            return self.api.receive_bucket(session, addr, body, self.config.weights.update_timeout)

        return await self._each(members, post)

    async def end(self, meta: WeightUpdateMeta,
                  failed: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The members not in `failed` (nor failing here) serve `meta.version` and continue.
        Returns those that received it, and every server dropped (and why): they are left
        paused, their groups discarded, until a later broadcast includes them."""
        self.failed.update(failed)
        session = self._session()
        done = tuple(a for a in self._members if a not in self.failed)
        try:
            async def end_one(addr: str) -> None:
                try:
                    await self.api.end_group_update(session, addr)
                finally:
                    await self.api.resume(session, addr)

            await self._each(done, end_one)
            received = [a for a in done if a not in self.failed]
            for addr in self.failed:
                self.groups.pop(addr, None)  # its group is broken; it joins a new one later
            return received, dict(self.failed)
        finally:
            self.failed = {}
            self._members = ()
