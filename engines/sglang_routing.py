"""Which SGLang server gets a request: fewest in-flight requests (or round robin), sticky by a
route key (the request's rid), avoiding servers that failed a moment ago.

Not thread-safe on purpose: RemoteSGLangEngine only touches it from its rollout loop.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict

MAX_STICKY_KEYS = 100_000  # LRU bound of the route key -> server map
FAILED_SERVER_COOLDOWN_S = 5.0  # a server that just failed is avoided for this long


class ServerPool:
    def __init__(self, addresses: list[str], policy: str = "least_inflight") -> None:
        if policy not in ("least_inflight", "round_robin"):
            raise ValueError(f"schedule policy {policy!r}: expected least_inflight/round_robin")
        self.addresses = list(addresses)
        self.policy = policy
        self.inflight = dict.fromkeys(self.addresses, 0)
        self.failed_at = dict.fromkeys(self.addresses, float("-inf"))
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.count()

    def _recently_failed(self, addr: str, now: float) -> bool:
        return now - self.failed_at[addr] <= FAILED_SERVER_COOLDOWN_S

    def choose(self, route_key: str, exclude: frozenset[str] = frozenset()) -> str:
        """`route_key`'s sticky server while it is fine, else the best other server (servers
        in `exclude` only when nothing else is left)."""
        now = time.monotonic()
        sticky = self._sticky.get(route_key)
        if sticky is not None and sticky not in exclude and not self._recently_failed(sticky, now):
            self._sticky.move_to_end(route_key)
            return sticky
        candidates = [a for a in self.addresses if a not in exclude] or list(self.addresses)
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
        self.failed_at[addr] = time.monotonic()
