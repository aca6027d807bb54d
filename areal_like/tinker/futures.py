"""The Tinker API's futures: a submitted request answers with a `request_id` at once; the SDK
long-polls `retrieve_future` until the result is there. Every future ends with a result or
an error with its reason; none is left pending by a dead task (`watch` fails it)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Optional, Union

from areal_like.tinker.errors import NotFound, TinkerError

logger = logging.getLogger(__name__)

Result = Union[dict[str, Any], bytes]  # JSON, or a protobuf message's bytes


@dataclass
class _Future:
    kind: str  # the SDK's request type, e.g. ForwardBackward
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Optional[Result] = None
    error: Optional[dict[str, str]] = None
    finished_at: float = 0.0


class FutureStore:
    """Futures by request id; finished ones are kept `keep_s` seconds (the SDK may poll
    again after a timeout of its own)."""

    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        self._futures: dict[str, _Future] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.failed = 0

    def create(self, kind: str) -> str:
        request_id = f"req-{next(self._ids)}"
        self._futures[request_id] = _Future(kind)
        return request_id

    def resolve(self, request_id: str, result: Result) -> None:
        future = self._futures[request_id]
        future.result, future.finished_at = result, time.monotonic()
        future.done.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        future = self._futures[request_id]
        category = error.category if isinstance(error, TinkerError) else "server"
        message = str(error) if isinstance(error, TinkerError) \
            else f"{type(error).__name__}: {error}"
        future.error = {"error": message, "category": category}
        future.finished_at = time.monotonic()
        self.failed += 1
        future.done.set()

    def watch(self, request_id: str, work: Awaitable[Result]) -> None:
        """Run `work` and resolve the future with its result, or fail it with its error."""
        async def run() -> None:
            try:
                self.resolve(request_id, await work)
            except asyncio.CancelledError:
                self.fail(request_id, RuntimeError("the server stopped before it finished"))
                raise
            except Exception as e:  # reported through the future, and logged here
                if not isinstance(e, TinkerError):
                    logger.exception("request %s failed", request_id)
                self.fail(request_id, e)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retrieve(self, request_id: str, wait_s: float) -> Optional[_Future]:
        """The finished future, or None when it is still pending after `wait_s` seconds."""
        self._drop_old()
        future = self._futures.get(request_id)
        if future is None:
            raise NotFound(f"no future {request_id!r} (unknown, or finished more than "
                           f"{self.keep_s:.0f} s ago)")
        try:
            await asyncio.wait_for(future.done.wait(), wait_s)
        except asyncio.TimeoutError:
            return None
        return future

    def pending(self) -> int:
        return sum(not f.done.is_set() for f in self._futures.values())

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _drop_old(self) -> None:
        cutoff = time.monotonic() - self.keep_s
        for request_id in [r for r, f in self._futures.items()
                           if f.done.is_set() and f.finished_at < cutoff]:
            del self._futures[request_id]
