"""A small reward-model server speaking the remote RM protocol (`remote_rm.py`).

    python -m areal_like.rewards.rm_server --port 5000          # binds 127.0.0.1
    ... reward.remote_rm_url=http://127.0.0.1:5000/get_reward

It scores each query with a rule: exact match of the completion's final answer (the query
minus its prompt) against the label. On start it prints one JSON line
`{"url": ..., "port": ...}` to stdout (with --port 0 the OS picks the port).

With --test-controls it also serves `POST /control {"mode": "ok" | "error" | "hang"}` (answer
500s, or never answer) and `GET /stats` (requests and batch sizes seen), for fault tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from aiohttp import web

from areal_like.rewards.exact_match import exact_match_reward

MODES = ("ok", "error", "hang")


def score_queries(queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
    """Exact-match scores; a query must start with its prompt and have a label."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"query/prompts/labels lengths differ: {len(queries)}, "
                         f"{len(prompts)}, {len(labels)}")
    scores = []
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
        if not query.startswith(prompt):
            raise ValueError(f"query {i} does not start with its prompt")
        if label is None:
            raise ValueError(f"query {i} has no label (the rule needs the answer)")
        scores.append(exact_match_reward(prompt, query[len(prompt):], str(label)))
    return scores


def make_app(path: str = "/get_reward", test_controls: bool = False) -> web.Application:
    state: dict[str, Any] = {"mode": "ok", "requests": 0, "batch_sizes": []}

    async def get_reward(request: web.Request) -> web.Response:
        state["requests"] += 1
        if state["mode"] == "error":
            return web.json_response({"error": "injected failure"}, status=500)
        if state["mode"] == "hang":
            await asyncio.sleep(3600)  # until the client gives up or the server is stopped
        try:
            body = await request.json()
            queries, prompts = body["query"], body["prompts"]
            labels = body.get("labels") or [None] * len(queries)
            scores = score_queries(queries, prompts, labels)
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=400)
        state["batch_sizes"].append(len(queries))
        return web.json_response({"rewards": scores})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def control(request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode")
        if mode not in MODES:
            return web.json_response({"error": f"mode={mode!r}; choose one of {MODES}"},
                                     status=400)
        state["mode"] = mode
        return web.json_response({"mode": mode})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({k: state[k] for k in ("mode", "requests", "batch_sizes")})

    app = web.Application()
    app.router.add_post(path, get_reward)
    app.router.add_get("/health", health)
    if test_controls:
        app.router.add_post("/control", control)
        app.router.add_get("/stats", stats)
    return app


async def _serve(host: str, port: int, path: str, test_controls: bool) -> None:
    runner = web.AppRunner(make_app(path, test_controls))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(json.dumps({"url": f"http://{host}:{bound}{path}", "port": bound}), flush=True)
    try:
        await asyncio.Event().wait()  # serve until killed
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000, help="0: any free port")
    parser.add_argument("--path", default="/get_reward")
    parser.add_argument("--test-controls", action="store_true")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.host, args.port, args.path, args.test_controls))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
