"""Which inference server gets a request: fewest in-flight requests (or round robin), sticky by a
route key (the request's rid), avoiding servers that failed a moment ago and never choosing a
server that is out of service (dead, failed a weight update, or not yet loaded with the
current weights).

Also `OwnAborts`, which tells the engine's own abort-mode pauses from real aborts.
Not thread-safe on purpose: RemoteSGLangEngine only touches these from its rollout loop.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterator

MAX_STICKY_KEYS = 100_000  # LRU bound of the route key -> server map
FAILED_SERVER_COOLDOWN_S = 5.0  # a server that just failed is avoided for this long


class NoServerInServiceError(RuntimeError):
    """Every server is out of service; the message names each one and why."""


class ServerPool:
    def __init__(self, addresses: list[str], policy: str = "least_inflight") -> None:
        if policy not in ("least_inflight", "round_robin"):
            raise ValueError(f"schedule policy {policy!r}: expected least_inflight/round_robin")
        self.addresses: list[str] = []
        self.policy = policy
        self.inflight: dict[str, int] = {}
        self.failed_at: dict[str, float] = {}
        self.out_of_service: dict[str, str] = {}  # address -> why
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._rids: set[str] = set()  # rids of the requests in flight, as sent
        self._turn = itertools.count()
        for addr in addresses:
            self.add(addr)

    def claim_rid(self, rid: str) -> str:
        """`rid`, or `rid~N` while a request sent as `rid` is in flight (release it after)."""
        wire, n = rid, 0
        while wire in self._rids:
            n += 1
            wire = f"{rid}~{n}"
        self._rids.add(wire)
        return wire

    def release_rid(self, wire: str) -> None:
        self._rids.discard(wire)

    def add(self, addr: str, reason: str = "") -> None:
        """Add a server; with `reason` it starts out of service (e.g. it must load weights)."""
        if addr in self.inflight:
            return
        self.addresses.append(addr)
        self.inflight[addr] = 0
        self.failed_at[addr] = float("-inf")
        if reason:
            self.out_of_service[addr] = reason

    def remove(self, addr: str) -> None:
        """Forget a server (drained). A request still in flight on it ends unrouted."""
        if addr not in self.inflight:
            return
        self.addresses.remove(addr)
        for table in (self.inflight, self.failed_at, self.out_of_service):
            table.pop(addr, None)

    def in_service(self) -> list[str]:
        return [a for a in self.addresses if a not in self.out_of_service]

    def take_out(self, addr: str, reason: str) -> bool:
        """Stop routing to `addr`; False if it was already out (or is not in the pool)."""
        if addr in self.out_of_service or addr not in self.inflight:
            return False
        self.out_of_service[addr] = reason
        return True

    def put_back(self, addr: str) -> None:
        if addr not in self.inflight:
            return  # removed (drained)
        self.out_of_service.pop(addr, None)
        self.failed_at[addr] = float("-inf")

    def describe_out_of_service(self) -> str:
        return "; ".join(f"{a}: {why}" for a, why in self.out_of_service.items()) or "none"

    def _recently_failed(self, addr: str, now: float) -> bool:
        return now - self.failed_at[addr] <= FAILED_SERVER_COOLDOWN_S

    def choose(self, route_key: str, exclude: frozenset[str] = frozenset()) -> str:
        """`route_key`'s sticky server while it is fine, else the best other server in service
        (servers in `exclude` only when nothing else is left)."""
        usable = self.in_service()
        if not usable:
            raise NoServerInServiceError(
                "no inference server in service (out of service: "
                f"{self.describe_out_of_service()})")
        now = time.monotonic()
        sticky = self._sticky.get(route_key)
        if (sticky is not None and sticky in usable and sticky not in exclude
                and not self._recently_failed(sticky, now)):
            self._sticky.move_to_end(route_key)
            return sticky
        candidates = [a for a in usable if a not in exclude] or usable
        healthy = [a for a in candidates if not self._recently_failed(a, now)]
        # All failed recently: try the one that failed longest ago.
        pool = healthy or sorted(candidates, key=lambda a: self.failed_at[a])[:1]
        turn = next(self._turn)
        if self.policy == "round_robin":
            addr = pool[turn % len(pool)]
        else:  # rotate the start so that ties spread evenly
            order = pool[turn % len(pool):] + pool[:turn % len(pool)]
            addr = min(order, key=lambda a: self.inflight[a])
        self._sticky[route_key] = addr
        self._sticky.move_to_end(route_key)
        if len(self._sticky) > MAX_STICKY_KEYS:
            self._sticky.popitem(last=False)
        return addr

    def mark_failed(self, addr: str) -> None:
        if addr in self.failed_at:
            self.failed_at[addr] = time.monotonic()


class OwnAborts:
    """Tells an abort caused by this engine pausing the fleet in "abort" mode (to be continued
    transparently) from a real one. A request sent while the pause is on its way to the
    server is aborted by it too, so the window counts as ours: `epoch` moves at both ends."""

    def __init__(self) -> None:
        self.epoch = 0
        self.pausing = 0

    def ours(self, epoch_at_send: int) -> bool:
        return self.pausing > 0 or self.epoch != epoch_at_send

    @contextlib.contextmanager
    def pause(self, aborts: bool) -> Iterator[None]:
        """Around a pause of the fleet; only a pause that aborts (`aborts`) counts."""
        if not aborts:
            yield
            return
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """A pause that aborts begins (`release` when it ends)."""
        self.epoch += 1
        self.pausing += 1

    def release(self) -> None:
        self.pausing -= 1
        self.epoch += 1
