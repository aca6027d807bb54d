"""A misbehaving stand-in for an SGLang server (real HTTP on loopback), for fault tests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from aiohttp import web


def _impossible_logprobs_reply() -> str:
    return json.dumps({"output_ids": [1, 2], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[0.5, 1, None],
                                                                        [-1.0, 2, None]]}})


class MisbehavingServer:
    """A real HTTP server on 127.0.0.1, healthy, whose /generate misbehaves in one way:
    `mode` is one of garbage, truncated, http500, silent, impossible_logprobs, or `body`
    (answer HTTP 200 with `body`)."""

    def __init__(self, mode: str, body: str = "") -> None:
        self.mode, self.body, self.requests = mode, body, 0
        self.loop = asyncio.new_event_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30), "test server did not start"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.mode == "silent":
            await self.release.wait()  # accepts, never answers (until the test ends)
        if self.mode == "http500":
            return web.Response(status=500, text="internal error")
        body = {"body": self.body, "garbage": "<html>502 bad gateway</html>",
                "truncated": _impossible_logprobs_reply()[:30],
                "impossible_logprobs": _impossible_logprobs_reply()}[self.mode]
        return web.Response(text=body, content_type="application/json")

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.release = asyncio.Event()
        app = web.Application()
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def model_info(_: web.Request) -> web.Response:
            return web.json_response({})

        app.router.add_get("/health", health)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/generate", self._generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        asyncio.run_coroutine_threadsafe(self.runner.shutdown(), self.loop).result(30)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
