"""Which inference servers serve, with which weights: servers leave service when they die, stop
answering or fail a weight update, and come back (or join) only after loading the current
weights and version.

Everything here runs on the client's rollout loop. A weight update is pause -> load -> continue
*per server*, the continue in that server's own `finally`; a server whose update failed is taken
out of service, so it never serves old weights under the new label. A watch task probes the
servers out of service every `health.check_interval` s, loads the current weights on those that
answer and puts them back; servers join and leave through `server_addrs_file`
(engines/fleet/addrs_file.py). A server whose
reply carries a version older than the one it held (restarted between requests) leaves service
the same way; one whose scheduler hangs behind a live HTTP front end (a request timed out and a
generation probe failed) comes back only after a generation probe passes. When fewer than
`min_servers` are in service for longer than `server_down_timeout` s, `on_fatal` gets a
`FleetUnavailableError` naming each server out of service and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import aiohttp

from areal_like.api.config import RolloutConfig
from areal_like.api.errors import FleetUnavailableError
from areal_like.api.io_struct import FleetView, UpdateReport, WeightUpdateMeta
from engines.fleet import identity, updates
from engines.fleet.addrs_file import AddressesFile
from engines.fleet.routing import NoServerInServiceError, OwnAborts, ServerPool
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError
from engines.server.http import RETRYABLE

logger = logging.getLogger("engines.fleet.client")

PROBE_TIMEOUT_S = 10.0  # a liveness probe (no generation involved)
HELD_REMINDER_S = 30.0  # an update normally holds the fleet for seconds: say when one lasts


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("probing an inference server failed", exc_info=task.exception())


@dataclass
class _HeldUpdate:
    view: FleetView
    aborts: bool  # its pauses abort requests: hold them as ours
    expiry: asyncio.TimerHandle
    timeout_s: float
    since: float  # monotonic
    reminder: Optional[asyncio.TimerHandle] = None


class FleetMembership:
    def __init__(self, config: RolloutConfig, pool: ServerPool,
                 session: Callable[[], aiohttp.ClientSession],
                 on_fatal: Callable[[BaseException], None], api: ServerAPI,
                 own_aborts: OwnAborts) -> None:
        self.config = config
        self.api = api
        self.own_aborts = own_aborts  # a pause that aborts requests: the client continues them
        self.pool = pool
        self._session = session
        self._on_fatal = on_fatal
        self.current: Optional[WeightUpdateMeta] = None  # what every server in service serves
        self._lock: Optional[asyncio.Lock] = None  # one update or readmission at a time
        self._below_min_since: Optional[float] = None
        self._checking: set[str] = set()
        self._hung: set[str] = set()  # out for failing a generation probe: readmit after one
        self._probes: set[asyncio.Task[None]] = set()
        self._watch_task: Optional[asyncio.Task[None]] = None
        # distributed transport: servers out of service that join the weight-update group at
        # the next broadcast (they cannot load the current weights on their own)
        self.awaiting_broadcast: set[str] = set()
        self.counts = {"taken_out": 0, "readmitted": 0, "added": 0, "drained": 0,
                       "refused": 0}
        # servers that join and leave through rollout.server_addrs_file
        self.refused: dict[str, str] = {}  # joined with another model: never served
        self.addrs_file = AddressesFile(config, pool, self.counts, self._require_lock,
                                        self.awaiting_broadcast)
        self.fatal: Optional[FleetUnavailableError] = None
        self.paused = False  # pause_all .. continue_all: no server can pass a generation probe
        self._held: Optional[_HeldUpdate] = None  # an update trainer rank 0 drives

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the watch task (call on the rollout loop)."""
        self._lock = asyncio.Lock()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        tasks = [*self._probes, *self.addrs_file.draining.values(),
                 *([self._watch_task] if self._watch_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watch_task = None
        self.addrs_file.stop()

    def _require_lock(self) -> asyncio.Lock:
        if self._lock is None:
            raise RuntimeError("FleetMembership.start() was not called")
        return self._lock

    def lock(self) -> asyncio.Lock:
        """Held by a weight update or a readmission (one at a time)."""
        return self._require_lock()

    async def await_healthy(self, addresses: list[str], timeout: float) -> None:
        """Poll the health of every server, all at once, until all are healthy; error after
        `timeout` s. A server left paused (by a client that died mid-update) is continued.
        (SGLang's /health generates a token and answers a second later at the earliest:
        one server after another would cost a second per server.)"""
        deadline = time.monotonic() + timeout
        polls = [asyncio.ensure_future(self._await_one_healthy(addr, deadline, timeout))
                 for addr in addresses]
        try:
            await asyncio.gather(*polls)  # the first server's error
        finally:  # ... stops the other polls
            for poll in polls:
                poll.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    async def _await_one_healthy(self, addr: str, deadline: float, timeout: float) -> None:
        last = "no answer"
        continued = False
        while True:
            session = self._session()
            not_generating = False  # a starting server says so at once (HTTP 503): not this
            try:
                wait = max(0.1, min(5.0, deadline - time.monotonic()))
                last = await self.api.health(session, addr, wait)
                if not last:
                    return
                not_generating = last == "paused"
            except RETRYABLE as e:  # (a timeout's text is empty: say what it waited for)
                last = f"{type(e).__name__}: {e}" if str(e) else (
                    f"{type(e).__name__}: no answer to /health within {wait:.0f} s")
                not_generating = isinstance(e, asyncio.TimeoutError)
            if (not continued and not_generating
                    and not await self.api.answers(session, addr, 5.0)):
                # up but not generating: maybe left paused; continuing is idempotent
                continued = True
                try:
                    await self.api.resume(session, addr)
                    logger.warning("%s server %s answered but was not generating "
                                   "(%s): continued it", self.api.name, addr, last)
                except InferenceServerError as e:
                    last += f"; continuing it failed: {e}"
            if time.monotonic() > deadline:
                raise InferenceServerError(
                    f"{self.api.name} server {addr} not healthy within {timeout:.0f} s "
                    f"(rollout.client.setup_timeout); last answer: {last}"
                )
            await asyncio.sleep(0.2)  # a starting server's first batch waits on this

    # ---- service ------------------------------------------------------------------------
    def take_out(self, addr: str, reason: str) -> None:
        if self.pool.take_out(addr, reason):
            self.counts["taken_out"] += 1
            logger.warning("inference server %s taken out of service: %s (%d of %d in service)",
                           addr, reason, len(self.pool.in_service()), len(self.pool.addresses))

    def served_version(self) -> Optional[int]:
        """The version every server in service holds at least (None: no update yet)."""
        return None if self.current is None else self.current.version

    def lost_weights(self, addr: str, versions: list[int],
                     floor: Optional[int]) -> Optional[InferenceServerError]:
        """A reply's tokens older than the version `addr` held when the request was sent:
        the server restarted between requests (launch weights). It leaves service (the watch
        loads the current weights on it) and the error is returned for the caller to retry."""
        if floor is None or not versions or min(versions) >= floor:
            return None
        why = (f"answered with weights version {min(versions)} although it held version "
               f"{floor} when the request was sent (restarted?)")
        self.take_out(addr, why)
        return InferenceServerError(f"inference server {addr} {why}")

    def lost_state(self, addr: str, why: str) -> InferenceServerError:
        """`addr` refused a request for lacking what every server in service holds (a
        restarted server without the policy's LoRA adapter): out of service like a server
        that lost its weights; the error is returned for the caller to retry."""
        self.take_out(addr, why)
        return InferenceServerError(f"inference server {addr} {why}")

    def await_broadcast(self, addr: str, reason: str) -> None:
        """Out of service until the next weight broadcast includes `addr`."""
        if addr not in self.pool.inflight or addr in self.addrs_file.draining:
            return  # drained (or draining): it leaves the fleet instead
        self.take_out(addr, reason)
        self.pool.out_of_service[addr] = reason
        if addr not in self.awaiting_broadcast:
            self.awaiting_broadcast.add(addr)
            logger.warning("inference server %s gets the weights at the trainer's next update "
                           "(%s): %s", addr, self.config.weights.transport, reason)

    def joined_broadcast(self, addr: str, version: int) -> None:
        """`addr` received a whole broadcast of `version`: back in service if it was out."""
        if addr in self.awaiting_broadcast and addr in self.pool.inflight \
                and addr not in self.addrs_file.draining:
            self.awaiting_broadcast.discard(addr)
            self.pool.put_back(addr)
            self.counts["readmitted"] += 1
            logger.warning("inference server %s back in service: received weights version %d "
                           "from the trainer (%d of %d in service)", addr,
                           version, len(self.pool.in_service()), len(self.pool.addresses))

    def check_soon(self, addr: str, error: BaseException) -> None:
        """A request to `addr` failed: probe it now, and take it out if it does not answer.
        After a timeout the probe is a generation (`generates`): a hung scheduler behind a
        live HTTP front end would pass the liveness probe and time out every request sent to
        it. That probe runs between weight updates (they pause the servers), never while the
        client has the fleet paused."""
        if addr in self._checking or addr in self.pool.out_of_service:
            return
        self._checking.add(addr)

        async def probe() -> str:
            if isinstance(error, asyncio.TimeoutError) and not self.paused:
                async with self._require_lock():
                    if not self.paused and addr not in self.pool.out_of_service:
                        why = await self.api.generates(
                            self._session(), addr, self.config.health.generation_probe_timeout)
                        if why:
                            self._hung.add(addr)
                        return why
            return await self.api.answers(self._session(), addr, PROBE_TIMEOUT_S)

        async def check() -> None:
            try:
                why = await probe()
                if why:
                    self.take_out(addr, f"not answering ({why}) after "
                                        f"{type(error).__name__}: {error}")
            finally:
                self._checking.discard(addr)

        task = asyncio.get_running_loop().create_task(check())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)
        task.add_done_callback(_log_failure)

    async def wait_in_service(self, route_key: str, exclude: frozenset[str]) -> str:
        """A server for `route_key`; while none is in service, wait (bounded by
        `server_down_timeout`) for one to come back."""
        deadline = time.monotonic() + self.config.health.server_down_timeout
        while True:
            if self.fatal is not None:
                raise self.fatal
            try:
                return self.pool.choose(route_key, exclude)
            except NoServerInServiceError as e:
                if time.monotonic() > deadline:
                    raise self._unavailable(
                        f"{e}; waited {self.config.health.server_down_timeout:.0f} s "
                        "(rollout.health.server_down_timeout)") from None
            await asyncio.sleep(min(0.5, self.config.health.check_interval))

    def _unavailable(self, what: str) -> FleetUnavailableError:
        return FleetUnavailableError(
            f"inference fleet unavailable: {what}. {len(self.pool.in_service())} of "
            f"{len(self.pool.addresses)} servers in service (rollout.health.min_servers="
            f"{self.config.health.min_servers}); out of service: "
            f"{self.pool.describe_out_of_service()}")

    async def on_all(self, what: str,
                     call: Callable[[aiohttp.ClientSession, str], Awaitable[None]]) -> None:
        """`call` every server in service concurrently; a server that fails leaves service
        (it is continued and reloaded before it serves again). Raises only when all fail."""
        targets, session = self.pool.in_service(), self._session()
        results = await asyncio.gather(*(call(session, a) for a in targets),
                                       return_exceptions=True)
        errors = [(a, r) for a, r in zip(targets, results, strict=True)
                  if isinstance(r, BaseException)]
        for addr, error in errors:
            if not isinstance(error, Exception):
                raise error
            self.take_out(addr, f"{what} failed: {error}")
        if targets and len(errors) == len(targets):
            raise errors[0][1]

    async def pause_all(self, mode: str) -> None:
        """Pause every server in service (the caller accounts for aborts it causes)."""
        self.paused = True  # first: a probe during the pause must not try to generate
        await self.on_all(f"pause ({mode})",
                          lambda session, addr: self.api.pause(session, addr, mode))

    async def continue_all(self) -> None:
        await self.on_all("continue", self.api.resume)
        self.paused = False

    # ---- weight updates -----------------------------------------------------------------
    async def update_one(self, addr: str, meta: Optional[WeightUpdateMeta]) -> None:
        """Pause `addr` (in-flight requests retracted, not lost), load `meta` (None: keep the
        weights), continue. The continue always runs, bounded by its own timeout."""
        with self.own_aborts.pause(aborts=self.api.aborts_on_pause(self.api.update_pause_mode)):
            await updates.update_one(self._session(), self.api, addr, meta,
                             self.config.weights.update_timeout)

    async def update_all(self, meta: WeightUpdateMeta) -> None:
        """Load `meta` on every server in service, each on its own; the servers that fail
        leave service (and load `meta` when they come back). Raises when no server loaded it
        and one that still answers refused it (the weights, not the servers, are at fault);
        the version is then not advanced."""
        async with self._require_lock():
            targets = self.pool.in_service()
            aborts = self.api.aborts_on_pause(self.api.update_pause_mode)
            with self.own_aborts.pause(aborts=aborts):
                failed = await updates.update_each(self._session(), self.api, targets, meta,
                                           self.config.weights.update_timeout)
            for addr, error in failed.items():
                self.take_out(addr, f"failed to load weights version {meta.version}: {error}")
            refused = await updates.refused_everywhere(self._session(), self.api, targets, failed,
                                               meta.version)
            if refused is not None:
                raise refused
            self.current = meta  # servers out of service load it before they serve again

    # ---- weight updates driven by trainer rank 0 (engines/fleet/updater.py) -------------
    async def hold_for_update(self, version: int, pause_mode: str,
                              expires_s: float) -> FleetView:
        """Hold the fleet for an update someone else drives: the lock (no readmission), and
        the aborts its pauses cause (continued). Released by `end_update`, or after
        `expires_s` s without one: the servers then leave service (their update is unknown)."""
        await asyncio.wait_for(self._require_lock().acquire(), self.config.weights.update_timeout)
        aborts = self.api.aborts_on_pause(pause_mode)
        if aborts:
            self.own_aborts.hold()
        view = FleetView(version=version, in_service=tuple(self.pool.in_service()),
                         awaiting_broadcast=tuple(sorted(self.awaiting_broadcast)),
                         out_of_service=self.pool.describe_out_of_service())
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(expires_s, self._expire_update, view)
        self._held = _HeldUpdate(view, aborts, expiry, expires_s, time.monotonic())
        self._held.reminder = loop.call_later(HELD_REMINDER_S, self._remind_held, self._held)
        return view

    def _remind_held(self, held: _HeldUpdate) -> None:
        """A hold is a silent wait for the trainer (stopped, swapping, slow): say so."""
        if self._held is not held:
            return
        waited = time.monotonic() - held.since
        logger.warning("the fleet has been held %.0f s for the trainer's update to weights "
                       "version %d (readmissions wait for it); it is released when the update "
                       "ends, or in %.0f s", waited, held.view.version, held.timeout_s - waited)
        held.reminder = asyncio.get_running_loop().call_later(HELD_REMINDER_S,
                                                              self._remind_held, held)

    def end_update(self, report: UpdateReport) -> bool:
        """Apply a driven update's `report` and release the hold; False if it had expired."""
        held, self._held = self._held, None
        if held is None or held.view.version != report.meta.version:
            self._held = held
            logger.error("weights version %d: its update ended after the fleet stopped waiting "
                         "for it; its servers are out of service until they reload",
                         report.meta.version)
            return False
        try:
            version = report.meta.version
            for addr, why in report.failed.items():
                if report.meta.driven_by_trainer:
                    self.await_broadcast(addr, f"dropped from the update to weights version "
                                               f"{version} ({why}); paused until a later "
                                               "update includes it")
                else:
                    self.take_out(addr, f"failed to load weights version {version}: {why}")
            if report.meta.driven_by_trainer:
                for addr in report.loaded:
                    self.joined_broadcast(addr, version)
            if report.advanced:
                self.current = report.meta  # servers out of service load it before they serve
        finally:
            self._release(held)
        return True

    def _expire_update(self, view: FleetView) -> None:
        held = self._held
        if held is None or held.view is not view:
            return
        self._held = None
        why = (f"the trainer did not finish its update to weights version {view.version} "
               f"within {held.timeout_s:.0f} s")
        for addr in view.in_service:  # readmitted (reloading) once they answer
            self.take_out(addr, why)
        self._release(held)

    def _release(self, held: _HeldUpdate) -> None:
        held.expiry.cancel()
        if held.reminder is not None:
            held.reminder.cancel()
        if held.aborts:
            self.own_aborts.release()
        self._require_lock().release()

    async def _same_model(self, addr: str) -> bool:
        """A server that joined serves the fleet's model (else it is refused for good)."""
        peers = [a for a in self.pool.in_service() if a != addr]
        try:
            why = await identity.mismatch(self._session(), self.api, addr,
                                          peers[0] if peers else None, self.config.vocab_size)
        except (InferenceServerError, identity.NotReady, *RETRYABLE) as e:  # asked again later
            self.pool.out_of_service[addr] = f"new: could not be asked what it serves ({e})"
            return False
        self.addrs_file.unchecked.discard(addr)
        self.refused.pop(addr, None)
        if why:
            self.refused[addr] = why
            self.pool.out_of_service[addr] = f"refused: {why}"
            self.counts["refused"] += 1
            logger.error("inference server %s refused: it %s; it never serves this run (take it "
                         "out of %s)", addr, why, self.config.server_addrs_file)
        return not why

    async def readmit(self, addr: str) -> bool:
        """Load the current weights on `addr` (it answers) and put it back in service."""
        async with self._require_lock():
            if addr not in self.pool.out_of_service:
                return True
            if self.current is not None and self.current.driven_by_trainer:
                self.await_broadcast(addr, f"answers again; receives weights (now version "
                                           f"{self.current.version}) at the trainer's next "
                                           "update")
                return False
            try:
                await self.update_one(addr, self.current)
            except Exception as e:  # noqa: BLE001 - stays out; the next probe tries again
                self.pool.out_of_service[addr] = f"could not load the current weights: {e}"
                return False
            self.pool.put_back(addr)
            self.counts["readmitted"] += 1
            version = self.current.version if self.current else "initial"
            logger.warning("inference server %s back in service with weights version %s (%d of %d "
                           "in service)", addr, version, len(self.pool.in_service()),
                           len(self.pool.addresses))
            return True

    # ---- the watch task -----------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                await self._watch_once()
            except FleetUnavailableError as e:
                self.fatal = e
                self._on_fatal(e)
                return
            except Exception:  # noqa: BLE001 - a probe bug must not end the watch silently
                logger.exception("inference fleet watch failed; retrying")
            await asyncio.sleep(self.config.health.check_interval)

    async def _watch_once(self) -> None:
        self.addrs_file.read()
        for addr in list(self.pool.out_of_service):
            if addr in self.addrs_file.draining or (
                    addr in self.refused and addr not in self.addrs_file.unchecked):
                continue  # (a refused server listed again is asked again)
            if await self.api.answers(self._session(), addr, PROBE_TIMEOUT_S):
                continue
            if addr in self.addrs_file.unchecked and not await self._same_model(addr):
                continue
            if addr in self._hung:
                if self.paused:
                    continue  # a paused server cannot show that it generates
                why = await self.api.generates(self._session(), addr,
                                               self.config.health.generation_probe_timeout)
                if why:  # loading weights on it would hold the lock until the load timed out
                    self.pool.out_of_service[addr] = f"scheduler still not generating ({why})"
                    continue
                self._hung.discard(addr)
            await self.readmit(addr)
        n = len(self.pool.in_service())
        if n >= self.config.health.min_servers:
            self._below_min_since = None
            return
        now = time.monotonic()
        if self._below_min_since is None:
            self._below_min_since = now
        elif now - self._below_min_since > self.config.health.server_down_timeout:
            raise self._unavailable(f"fewer than {self.config.health.min_servers} servers in "
                                    f"service for {self.config.health.server_down_timeout:.0f} s "
                                    f"(rollout.health.server_down_timeout)")

    def stats(self) -> dict[str, Any]:
        return {"in_service": len(self.pool.in_service()), "servers": len(self.pool.addresses),
                **{f"{k}_total": v for k, v in self.counts.items()}}
