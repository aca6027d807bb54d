"""Keep a local inference fleet up: restart a server that died (up to `max_restarts` times each),
and stop only when fewer than `min_alive` servers are left, naming every dead one.

Used by the local launcher and by `areal-like serve`. Clients notice a dead server on their own
(it leaves their routing and weight updates) and load their current weights on it when it is
back, so restarting here is all an operator's fleet needs.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from engines.fleet.launch import InferenceFleet


class FleetDownError(RuntimeError):
    """Fewer than the minimum number of servers are alive; the message names each dead one,
    how it died and its log tail."""


class FleetSupervisor:
    def __init__(self, fleet: InferenceFleet, max_restarts: int, min_alive: int = 1,
                 out: TextIO = sys.stderr, prefix: str = "[launcher]",
                 on_restart: Callable[[int], None] = lambda i: None) -> None:
        self.fleet = fleet
        self.max_restarts = max_restarts
        self.min_alive = min_alive
        self.out = out
        self.prefix = prefix
        self.on_restart = on_restart
        self.restarts = [0] * len(fleet.processes)
        self.given_up: dict[int, str] = {}  # server index -> how it died

    def _say(self, text: str) -> None:
        self.out.write("".join(f"{self.prefix} {line}\n" for line in text.splitlines()))
        self.out.flush()

    def check(self) -> None:
        """Restart servers that died (within their budget); raise `FleetDownError` when fewer
        than `min_alive` are left."""
        for i in self.fleet.dead_servers():
            if i in self.given_up:
                continue
            death = self.fleet.describe_death(i)
            if self.restarts[i] < self.max_restarts:
                self.restarts[i] += 1
                self._say(f"{death}\nrestarting {self.fleet.kind} server {i} "
                          f"(restart {self.restarts[i]} of {self.max_restarts})")
                self.fleet.restart_server(i)
                self.on_restart(i)
            else:
                self.given_up[i] = death
                self._say(f"{death}\nnot restarting {self.fleet.kind} server {i}: its "
                          f"{self.max_restarts} restart(s) (server.max_restarts) are used up")
        alive = len(self.fleet.processes) - len(self.given_up)
        if alive < self.min_alive:
            dead = "\n".join(self.given_up[i] for i in sorted(self.given_up))
            raise FleetDownError(
                f"{alive} of {len(self.fleet.processes)} {self.fleet.kind} servers alive, fewer "
                f"than the minimum {self.min_alive} (rollout.health.min_servers):\n{dead}")
