"""The agent gateway: an HTTP server that agent programs reach through the OpenAI or Anthropic
SDK (or any HTTP client), backed by the fleet, recording every call for training.

    gateway = AgentGateway(engine, tokenizer, gconfig)     # on the engine's event loop
    await gateway.start()                                  # 127.0.0.1, a free port
    session = gateway.open_session()
    # the agent: OpenAI(base_url=gateway.session_url(session), api_key="...") or
    # Anthropic(base_url=gateway.session_root(session), api_key="..."); or the session key
    # as the api_key with the gateway's bare URL
    client = await gateway.close_session(session.key)      # an ArealOpenAI: rewards, export

Endpoints, under `/s/<key>` (the session in the URL) or bare (the session key as the bearer
token or `x-api-key`):
- `POST /v1/chat/completions` (OpenAI): messages, tools, tool_choice, temperature, top_p,
  max_tokens / max_completion_tokens, stop, logprobs, stream (+ stream_options.include_usage);
- `POST /v1/messages` (Anthropic): system, messages with text / tool_use / tool_result blocks,
  tools with input_schema, tool_choice auto / none, max_tokens, stop_sequences, temperature,
  top_p, stream;
- `GET /v1/models`.
Errors come in each API's own shape with `x-should-retry: false` (409 after the session's
close, 401 for a missing or unknown key, 400 for a malformed request naming the field, 413 for
a body past the gateway's limit, 404 for a path it does not serve). The limit follows the
model's context (`body_limit`): a body that could not fit a prompt is refused before it is
read; messages longer in characters than the context times the vocabulary's longest token
are refused before they are rendered; and the prompt is rendered and tokenized beside the
event loop, so no call stalls the other sessions' calls
(`benchmarks/gateway_concurrency.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from aiohttp import web

from areal_like.api.errors import RequestRejected
from workflows.gateway import anthropic_api, openai_api
from workflows.gateway.openai_api import BadRequest, invalid_tool_calls
from workflows.gateway.sessions import (
    AgentSession,
    SessionClosedError,
    SessionTable,
    UnknownSessionError,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_like.api import GenerationHyperparameters, InferenceEngine
    from workflows.openai_client import ArealOpenAI, RecordedCompletion

logger = logging.getLogger(__name__)
NO_RETRY = {"x-should-retry": "false"}  # a refused call is not sent again by the SDKs
BYTES_PER_POSITION = 64  # a body's bytes per context position: JSON and escapes included
MIN_BODY_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20  # where the model's context is not known


def model_context(tokenizer: Any) -> Optional[int]:
    """The model's context in positions (its config.json beside the tokenizer), if known."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    try:
        positions = json.loads((folder / "config.json").read_text()).get(
            "max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return positions if isinstance(positions, int) and positions > 0 else None


def body_limit(tokenizer: Any) -> int:
    """The largest request body taken: `BYTES_PER_POSITION` per position of the model's
    context, at least 1 MiB; 64 MiB where the context is not known."""
    positions = model_context(tokenizer)
    if positions is None:
        return MAX_BODY_BYTES
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BYTES_PER_POSITION * positions))


def longest_token(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (its raw form: at least one character
    per character it decodes to): no text of N characters is fewer than N / this tokens."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def text_chars(value: Any) -> int:
    """Characters of every string in a request's messages (and tools)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


@dataclass(frozen=True)
class Dialect:
    """What differs between the two APIs: the request's arguments, the reply, its stream
    events (event name, data), the error body, the stream's last line."""

    parse: Callable[[dict[str, Any]], dict[str, Any]]
    reply: Callable[[Any, RecordedCompletion, ArealOpenAI, dict[str, Any]], dict[str, Any]]
    events: Callable[[dict[str, Any], dict[str, Any]], list[tuple[Optional[str], dict[str, Any]]]]
    error: Callable[[str, str, Optional[str]], dict[str, Any]]
    done: bytes


def _openai_error(message: str, kind: str, param: Optional[str]) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _openai_events(reply: dict[str, Any], body: dict[str, Any]
                   ) -> list[tuple[Optional[str], dict[str, Any]]]:
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return [(None, chunk) for chunk in openai_api.completion_chunks(reply, usage)]


def _anthropic_events(reply: dict[str, Any], body: dict[str, Any]
                      ) -> list[tuple[Optional[str], dict[str, Any]]]:
    return list(anthropic_api.message_events(reply))


OPENAI = Dialect(
    parse=openai_api.create_arguments,
    reply=lambda completion, record, client, body: openai_api.completion_json(
        completion, record, client, bool(body.get("logprobs"))),
    events=_openai_events, error=_openai_error, done=b"data: [DONE]\n\n")
ANTHROPIC = Dialect(
    parse=anthropic_api.create_arguments,
    reply=lambda completion, record, client, body: anthropic_api.message_json(completion,
                                                                              record),
    events=_anthropic_events, error=anthropic_api.error_body, done=b"")


def _dialect(request: web.Request) -> Dialect:
    return ANTHROPIC if request.path.endswith("/v1/messages") else OPENAI


@web.middleware
async def _errors_in_the_apis_shape(request: web.Request,
                                    handler: Callable[[web.Request],
                                                      Awaitable[web.StreamResponse]]
                                    ) -> web.StreamResponse:
    """aiohttp's own refusals (no such path, wrong method, a body past the limit) in the
    API's JSON error shape instead of plain text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large"}.get(e.status, "api_error")
        message = f"{request.method} {request.path}: {e.reason}"
        return web.json_response(_dialect(request).error(message, kind, None),
                                 status=e.status, headers=NO_RETRY)


def _session_key(request: web.Request) -> str:
    """The session: in the URL (`/s/<key>/...`), else the bearer token or `x-api-key`."""
    auth = request.headers.get("Authorization", "")
    bearer = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
    return request.match_info.get("key") or bearer or request.headers.get("x-api-key") or ""


class AgentGateway:
    """OpenAI-compatible endpoints over per-session recording clients (see the module doc).
    Runs on the event loop that owns `engine`'s connections."""

    def __init__(self, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                 gconfig: Optional[GenerationHyperparameters] = None, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "policy") -> None:
        self.engine, self.tokenizer, self.gconfig = engine, tokenizer, gconfig
        self.host, self.port, self.model_name = host, port, model_name
        self.sessions = SessionTable()
        self.max_body_bytes = body_limit(tokenizer)
        # a prompt that cannot fit is refused before it is rendered and tokenized (the
        # tokenizer is one lock that every session's calls take)
        context = model_context(tokenizer)
        self.token_chars = longest_token(tokenizer)
        self.max_prompt_chars = None if context is None else context * self.token_chars
        self._in_flight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._runner: Optional[web.AppRunner] = None

    # ---- lifecycle ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[_errors_in_the_apis_shape])
        chat, messages = self._endpoint(OPENAI), self._endpoint(ANTHROPIC)
        app.add_routes([web.post("/s/{key}/v1/chat/completions", chat),
                        web.post("/v1/chat/completions", chat),
                        web.post("/s/{key}/v1/messages", messages),
                        web.post("/v1/messages", messages),
                        web.get("/s/{key}/v1/models", self._models),
                        web.get("/v1/models", self._models)])
        return app

    async def start(self) -> str:
        """Listen (on 127.0.0.1 unless `host` says otherwise); the gateway's base URL."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the one chosen for port 0
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- sessions -----------------------------------------------------------------------
    def open_session(self) -> AgentSession:
        from workflows.openai_client import ArealOpenAI

        session = self.sessions.open(ArealOpenAI(self.engine, self.tokenizer, self.gconfig))
        self._in_flight[session.key] = 0
        self._idle[session.key] = asyncio.Event()
        self._idle[session.key].set()
        return session

    def session_root(self, session: AgentSession) -> str:
        """The Anthropic SDK's `base_url` for this session (the SDK adds `/v1/messages`)."""
        return f"{self.url}/s/{session.key}"

    def session_url(self, session: AgentSession) -> str:
        """The OpenAI SDK's `base_url` for this session (any api_key then works)."""
        return f"{self.session_root(session)}/v1"

    async def close_session(self, key: str, timeout: float = 60.0) -> ArealOpenAI:
        """Refuse the session's later calls, wait (at most `timeout` s) for the calls under
        way to be recorded, and return its recording client."""
        session = self.sessions.close(key)
        try:
            await asyncio.wait_for(self._idle[key].wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"agent session {key!r}: {self._in_flight[key]} call(s) still "
                               f"under way {timeout:g} s after its close") from None
        del self._in_flight[key], self._idle[key]
        return session.client

    # ---- endpoints ----------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        key = _session_key(request)
        try:
            self.sessions.get(key)
        except UnknownSessionError as e:
            return web.json_response(_dialect(request).error(
                str(e.args[0]), "authentication_error", None), status=401, headers=NO_RETRY)
        except SessionClosedError:
            pass  # (listing what it served is harmless)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "areal-like"}]})

    def _endpoint(self, dialect: Dialect
                  ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, dialect)
        return serve

    async def _serve(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        def error(status: int, message: str, kind: str,
                  param: Optional[str] = None) -> web.Response:
            return web.json_response(dialect.error(message, kind, param), status=status,
                                     headers=NO_RETRY)

        key = _session_key(request)
        try:
            session = self.sessions.get(key)
        except UnknownSessionError as e:
            return error(401, str(e.args[0]), "authentication_error")
        except SessionClosedError as e:
            return error(409, str(e), "invalid_request_error")
        counts = self.sessions.counts
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            kwargs = dialect.parse(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            counts["bad_requests"] += 1
            return error(400, f"the request body is not JSON: {e}", "invalid_request_error")
        except web.HTTPRequestEntityTooLarge:
            counts["bad_requests"] += 1
            return error(413, f"the request body is over this gateway's limit of "
                         f"{self.max_body_bytes} bytes (the model's context cannot hold it)",
                         "request_too_large")
        except BadRequest as e:
            counts["bad_requests"] += 1
            return error(400, str(e), "invalid_request_error", e.param)
        chars = text_chars([kwargs.get("messages"), kwargs.get("tools")])
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            counts["bad_requests"] += 1
            return error(400, f"the messages hold {chars} characters: at least "
                         f"{chars // self.token_chars} tokens (no token here is longer than "
                         f"{self.token_chars} characters), past the model's context of "
                         f"{self.max_prompt_chars // self.token_chars} positions",
                         "invalid_request_error", "messages")
        client = session.client
        self._in_flight[key] += 1
        self._idle[key].clear()
        try:
            # in the session's context: the episode's sampling seeds (see AgentSession)
            completion = await session.context.run(
                asyncio.ensure_future, client.chat.completions.create(**kwargs))
        except (TypeError, ValueError) as e:  # arguments the recorder refuses, naming them
            counts["bad_requests"] += 1
            return error(400, str(e), "invalid_request_error")
        except RequestRejected as e:  # (past the context, ...): any server would refuse it
            counts["bad_requests"] += 1
            return error(400, f"the inference server refused this call: {e}",
                         "invalid_request_error")
        except Exception as e:  # the fleet failed: the agent is told, the run's log says why
            counts["server_errors"] += 1
            logger.warning("agent gateway: a completion of session %s failed: %r", key, e)
            return error(503, f"the inference fleet failed this call: {e!r}", "api_error")
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                self._idle[key].set()
        record = next(r for r in reversed(client.completions) if r.id == completion.id)
        counts["calls"] += 1
        if kwargs.get("tools"):
            invalid = invalid_tool_calls(record, client)
            counts["invalid_tool_calls"] += invalid
            session.invalid_tool_calls += invalid
        reply = dialect.reply(completion, record, client, body)
        if not body.get("stream"):
            return web.json_response(reply)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for event, data in dialect.events(reply, body):
            head = f"event: {event}\n" if event else ""
            await stream.write(f"{head}data: {json.dumps(data)}\n\n".encode())
        if dialect.done:
            await stream.write(dialect.done)
        await stream.write_eof()
        return stream
