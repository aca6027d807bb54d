"""A small reward-model server speaking the remote RM protocol (`remote_rm.py`).

    python -m areal_like.rewards.rm_server --port 5000          # binds 127.0.0.1
    ... reward.remote_rm_url=http://127.0.0.1:5000/get_reward

It scores each query with a rule: exact match of the completion's final answer (the query
minus its prompt) against the label; with `--model DIR`, by a trained reward model instead
(`recipes.rm`'s `final/`, see `rm_model.py`): the score of prompt + completion (labels
unread). A folder without a one-output score head is refused at start, naming its head.
On start it prints one JSON line `{"url": ..., "port": ...}` to stdout (with --port 0 the
OS picks the port).

With --test-controls it also serves `POST /control {"mode": "ok" | "error" | "hang"}` (answer
500s, or never answer) and `GET /stats` (requests and batch sizes seen), for fault tests.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import sys
from typing import Any, Callable, Optional

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


def model_scorer(folder: str) -> Callable[[list[str], list[str], list[Any]], list[float]]:
    """score(queries, prompts, labels) by the reward model in `folder` (labels unread)."""
    from areal_like.rewards.rm_model import RewardModel

    model = RewardModel(folder)

    def score(queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
        if len(queries) != len(prompts):
            raise ValueError(f"query/prompts lengths differ: {len(queries)}, {len(prompts)}")
        bad = [i for i, (q, p) in enumerate(zip(queries, prompts, strict=True))
               if not q.startswith(p)]
        if bad:
            raise ValueError(f"query {bad[0]} does not start with its prompt")
        scores = model.score(prompts, [q[len(p):] for q, p in zip(queries, prompts, strict=True)])
        if not all(math.isfinite(s) for s in scores):
            raise RuntimeError(f"the reward model {folder} gave a non-finite score")
        return scores

    return score


def make_app(path: str = "/get_reward", test_controls: bool = False,
             scorer: Optional[Callable[[list[str], list[str], list[Any]], list[float]]] = None
             ) -> web.Application:
    state: dict[str, Any] = {"mode": "ok", "requests": 0, "batch_sizes": []}
    score_fn = scorer or score_queries
    # a model scores one batch at a time, off the event loop (health checks keep answering;
    # concurrent forwards would only oversubscribe the cores and share one tokenizer)
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1) if scorer else None

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
            scores = (await asyncio.get_running_loop().run_in_executor(
                model_thread, score_fn, queries, prompts, labels) if model_thread
                else score_fn(queries, prompts, labels))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=400)
        except RuntimeError as e:  # never a substitute score
            return web.json_response({"error": str(e)}, status=500)
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


async def _serve(host: str, port: int, path: str, test_controls: bool, model: str) -> None:
    runner = web.AppRunner(make_app(path, test_controls, model_scorer(model) if model else None))
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
    parser.add_argument("--model", default="", help="a reward-model folder (recipes.rm's "
                        "final/); default: the exact-match rule")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.host, args.port, args.path, args.test_controls, args.model))
    except KeyboardInterrupt:
        sys.exit(0)
    except (ValueError, FileNotFoundError) as e:  # a folder that is not a reward model
        print(f"rm_server: --model {args.model}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
