"""A daemon thread that owns an asyncio event loop, with bounded, thread-safe entry points.

Coroutines that must share state with rollouts (an aiohttp session, in-flight requests) run
on this loop: `run_coroutine(coro, timeout)` from any other thread, `await run_here(coro)`
from a coroutine on any loop, `call_soon(fn)` for cheap callbacks. An exception that escapes
a callback or a forgotten task is recorded (`error`) and handed to `on_error`, so the owner
can re-raise it in the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


class LoopThreadError(RuntimeError):
    """The event-loop thread failed or is not running."""


class EventLoopThread:
    def __init__(self, name: str, on_error: Optional[Callable[[BaseException], None]] = None):
        self.name = name
        self._on_error = on_error
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self.error: Optional[BaseException] = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise LoopThreadError(f"event-loop thread {self.name!r} did not start in {timeout} s")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(self._handle_loop_exception)
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._started.set()
        try:
            loop.run_forever()
        except BaseException as exc:  # the loop itself died: record it for the owner
            self._record(exc)
        finally:
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every task, stop the loop and join the thread, all within `timeout` s."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return
        try:
            self.run_coroutine(_cancel_all_tasks(), timeout=timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        if thread.is_alive():
            raise LoopThreadError(
                f"event-loop thread {self.name!r} did not stop within {timeout} s; a coroutine "
                f"or callback is blocking it"
            )

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            raise LoopThreadError(f"event-loop thread {self.name!r} is not running")
        return self._loop

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- entry points -------------------------------------------------------------------
    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run_coroutine(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and return its result; cancel it and raise TimeoutError after
        `timeout` s. Exceptions raised by `coro` propagate unchanged."""
        if self.in_loop_thread():
            coro.close()
            raise LoopThreadError(
                "run_coroutine() called from the event-loop thread itself would deadlock; "
                "`await` the coroutine instead"
            )
        try:
            loop = self.loop
        except LoopThreadError:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"coroutine {getattr(coro, '__qualname__', coro)!r} on {self.name!r} did not "
                f"finish within {timeout} s (cancelled)"
            ) from None

    async def run_here(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on this loop from a coroutine running on any loop (on this one: as
        is; elsewhere: scheduled here, the caller's loop waiting without blocking)."""
        try:
            loop = self.loop
        except LoopThreadError:
            coro.close()
            raise
        if asyncio.get_running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    # ---- errors -------------------------------------------------------------------------
    def _handle_loop_exception(self, loop: asyncio.AbstractEventLoop, ctx: dict) -> None:
        exc = ctx.get("exception")
        if exc is None:
            exc = LoopThreadError(f"event loop {self.name!r}: {ctx.get('message')}")
        self._record(exc)

    def _record(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self._on_error is not None:
            self._on_error(exc)


async def _cancel_all_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
