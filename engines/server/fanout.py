"""One call per server of a fleet, at once, each failing on its own."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable


async def on_each(servers: list[str],
                  call: Callable[[str], Awaitable[object]]) -> dict[str, BaseException]:
    """`call(server)` on every server at once; the servers that failed, with their errors
    (a cancellation is re-raised: it is not a server's fault)."""
    results = await asyncio.gather(*(call(a) for a in servers), return_exceptions=True)
    failed = {a: r for a, r in zip(servers, results, strict=True)
              if isinstance(r, BaseException)}
    for error in failed.values():
        if not isinstance(error, Exception):
            raise error
    return failed
