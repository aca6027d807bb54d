"""The Tinker REST API (as the `tinker` 0.38 SDK speaks it) over `TinkerService`: aiohttp
routes under /api/v1, `X-API-Key` auth, errors as the SDK maps them (HTTP status on direct
calls, `{"error", "category"}` through futures). docs/tinker.md lists every endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Callable, Optional

from aiohttp import web

from areal_like.tinker import fields, runs
from areal_like.tinker.callers import CALLER, key_fingerprint, model_seq_id, request_digest
from areal_like.tinker.errors import TinkerError, UserError
from areal_like.tinker.sampling import SamplingParams
from areal_like.tinker.service import TinkerService
from areal_like.tinker.wire import decode_forward_backward

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROTO = "application/x-protobuf"


def build_app(service: TinkerService, api_key: Optional[str] = None,
              poll_wait_s: float = 30.0, default_max_tokens: int = 256,
              context_length: int = 32768) -> web.Application:
    """`api_key`: the one key accepted (None: any key the SDK accepts, `tml-...`)."""
    app = web.Application(middlewares=[_errors, _auth(api_key)], client_max_size=1 << 30)
    s = service

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except (ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
            raise UserError(f"{request.path}: the body is not JSON ({e})") from e
        if not isinstance(data, dict):
            raise UserError(f"{request.path}: the body is not a JSON object")
        return data

    def future(request_id: str, **extra: Any) -> web.Response:
        return web.json_response({"request_id": request_id, **extra})

    async def client_config(request: web.Request) -> web.Response:
        return web.json_response({"pjwt_auth_enabled": False})

    async def dynamic_config(request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def capabilities(request: web.Request) -> web.Response:
        return web.json_response({"supported_models": [{
            "model_name": s.config.model_name, "max_context_length": context_length,
            "trainable": True, "sampleable": True}]})

    async def create_session(request: web.Request) -> web.Response:
        await body(request)
        return web.json_response({"session_id": s.create_session(), "type": "create_session"})

    async def heartbeat(request: web.Request) -> web.Response:
        s.session(str((await body(request)).get("session_id")))
        return web.json_response({"type": "session_heartbeat"})

    async def finish(request: web.Request) -> web.Response:
        await s.finish_callers_session(request.match_info["session_id"])
        return web.json_response({})

    async def telemetry(request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def create_model(request: web.Request) -> web.Response:
        data = await body(request)
        request_id = s.create_model(data)
        model_id = f"{data.get('session_id')}:train:{model_seq_id(data)}"
        return future(request_id, model_id=model_id)

    async def get_info(request: web.Request) -> web.Response:
        return web.json_response(s.info(str((await body(request)).get("model_id"))))

    async def forward_backward(request: web.Request) -> web.Response:
        if request.content_type != PROTO:
            raise UserError(f"forward_backward takes {PROTO} (tinker SDK >= 0.38), got "
                            f"{request.content_type}")
        raw = await request.read()
        call = decode_forward_backward(raw, request.headers.get("Content-Encoding", ""))
        return future(s.forward_backward(call, request_digest(raw)), model_id=call.model_id)

    def json_call(method: Callable[[dict[str, Any]], str]) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            return future(method(await body(request)))
        return handle

    async def create_sampling_session(request: web.Request) -> web.Response:
        return web.json_response({"sampling_session_id":
                                  s.create_sampling_session(await body(request))})

    async def sampler(request: web.Request) -> web.Response:
        return web.json_response(s.sampler_info(request.match_info["sampler_id"]))

    async def asample(request: web.Request) -> web.Response:
        data = await body(request)
        params = SamplingParams.parse(fields.mapping(data, "sampling_params"),
                                      default_max_tokens, context_length)
        prompt = _prompt_tokens(data.get("prompt"))
        if len(prompt) + params.max_tokens > context_length:
            raise UserError(f"asample: the prompt ({len(prompt)} tokens) and max_tokens="
                            f"{params.max_tokens} exceed the model's context of "
                            f"{context_length} positions")
        request_id = s.asample(data, params, prompt)
        n = fields.integer(data, "num_samples", 1)
        return future(request_id, sample_sequence_ids=[f"{request_id}-{i}" for i in range(n)])

    async def retrieve(request: web.Request) -> web.Response:
        data = await body(request)
        request_id = str(data.get("request_id"))
        done = await s.futures.retrieve(request_id, poll_wait_s)
        if done is None:
            return web.json_response({"type": "try_again", "request_id": request_id,
                                      "queue_state": "active"})
        if done.error is not None:
            return web.json_response(done.error)
        if isinstance(done.result, bytes):
            return web.Response(body=done.result, content_type=PROTO)
        return web.json_response(done.result)

    async def weights_info(request: web.Request) -> web.Response:
        return web.json_response(s.weights_info(str((await body(request)).get("tinker_path"))))

    async def training_run(request: web.Request) -> web.Response:
        return web.json_response(s.training_run(request.match_info["run_id"]))

    async def training_runs(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", 20))
            offset = int(request.query.get("offset", 0))
        except ValueError as e:
            raise UserError(f"training_runs: limit and offset must be integers ({e})") from e
        if not (1 <= limit <= 1000 and offset >= 0):
            raise UserError(f"training_runs: limit={limit}, offset={offset}: expected a limit "
                            f"in 1..1000 and an offset >= 0")
        return web.json_response(s.training_runs(limit, offset))

    async def run_checkpoints(request: web.Request) -> web.Response:
        run = s.training_run(request.match_info["run_id"])  # (404 for an unknown run)
        return web.json_response({"checkpoints": runs.checkpoints(
            s.config.storage_dir, run["training_run_id"].replace(":", "_"))})

    async def delete_checkpoint(request: web.Request) -> web.Response:
        await s.delete_checkpoint(request.match_info["run_id"],
                                  request.match_info["checkpoint_id"])
        return web.json_response({})

    async def stats(request: web.Request) -> web.Response:
        """Not Tinker's: what this server holds now (for operators and tests)."""
        return web.json_response({
            "sessions": len(s.sessions), "models": sorted(s.models),
            "sampling_sessions": len(s.sampling_sessions), "reaped_sessions": s.reaped,
            "pending_futures": s.futures.pending(), "failed_futures": s.futures.failed,
            "fleet": s.sampler.addresses,
            "loaded_adapters": sorted(p for p, a in s.sampler.adapters.items() if a.loaded)})

    v1 = "/api/v1"
    app.add_routes([
        web.post(f"{v1}/client/config", client_config),
        web.post(f"{v1}/client/dynamic_config", dynamic_config),
        web.get(f"{v1}/healthz", healthz),
        web.get(f"{v1}/get_server_capabilities", capabilities),
        web.post(f"{v1}/create_session", create_session),
        web.post(f"{v1}/session_heartbeat", heartbeat),
        web.post(f"{v1}/sessions/{{session_id}}/finish", finish),
        web.post(f"{v1}/telemetry", telemetry),
        web.post(f"{v1}/create_model", create_model),
        web.post(f"{v1}/get_info", get_info),
        web.post(f"{v1}/forward_backward", forward_backward),
        web.post(f"{v1}/optim_step", json_call(s.optim_step)),
        web.post(f"{v1}/save_weights", json_call(s.save_weights)),
        web.post(f"{v1}/save_weights_for_sampler", json_call(s.save_weights_for_sampler)),
        web.post(f"{v1}/load_weights", json_call(s.load_weights)),
        web.post(f"{v1}/create_sampling_session", create_sampling_session),
        web.get(f"{v1}/samplers/{{sampler_id}}", sampler),
        web.post(f"{v1}/asample", asample),
        web.post(f"{v1}/retrieve_future", retrieve),
        web.post(f"{v1}/weights_info", weights_info),
        web.get(f"{v1}/training_runs", training_runs),
        web.get(f"{v1}/training_runs/{{run_id}}", training_run),
        web.get(f"{v1}/training_runs/{{run_id}}/checkpoints", run_checkpoints),
        web.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:.+}}",
                   delete_checkpoint),
        web.get("/areal_like/stats", stats),
    ])
    app.cleanup_ctx.append(_reaper(s))
    return app


def _prompt_tokens(prompt: Any) -> list[int]:
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise UserError("asample: prompt.chunks must be a non-empty list")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"asample: prompt chunk {i} is {kind!r}; this server samples text "
                            f"(encoded_text chunks) only")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"asample: prompt chunk {i}'s tokens must be a list of token ids")
        tokens += ids
    if not tokens:
        raise UserError("asample: the prompt has no tokens")
    return tokens


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except TinkerError as e:
        return web.json_response({"detail": str(e), "category": e.category}, status=e.status)
    except web.HTTPException as e:  # aiohttp's own (no such path, wrong method): as JSON too
        if e.status < 400:
            raise
        return web.json_response({"detail": f"{request.method} {request.path}: {e.reason}",
                                  "category": "user"}, status=e.status)
    except Exception as e:  # answered with its reason, and logged with its trace
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"detail": f"{type(e).__name__}: {e}"}, status=500)


def _auth(api_key: Optional[str]) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/api/v1/") and not request.path.endswith("/healthz"):
            given = request.headers.get("X-API-Key", "")
            if not given or (api_key is not None and given != api_key):
                return web.json_response({"detail": "missing or wrong X-API-Key"}, status=401)
            CALLER.set(key_fingerprint(given))  # whose sessions, models and samplers
        return await handler(request)
    return check


def _reaper(service: TinkerService) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            period = max(0.5, min(5.0, service.config.session_timeout_s / 4))
            while True:
                await asyncio.sleep(period)
                started = time.monotonic()
                try:
                    await service.reap()
                except Exception:  # a reaper that dies would leave sessions forever
                    logger.exception("reaping sessions failed")
                if time.monotonic() - started > 60:
                    logger.warning("reaping sessions took %.0f s", time.monotonic() - started)

        task = asyncio.ensure_future(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.futures.cancel_all()
    return run
