"""Requests of the fleet client: posting with retries, and samples made of segments.

`post` sends one request (a sample, a group of a prompt's samples, a scoring batch) to a server
in service and retries it elsewhere after a failure (connection errors, timeouts, HTTP 5xx,
malformed or impossible replies); a reply older than the weights its server held when it was
sent (the server restarted) is retried while that server reloads. A request whose server
dropped it mid-way (the server died, or its connection did) is sent once more, to another
server where one is in service (the same one, restarted, in a one-server fleet); dropped a
second time it is a `PoisonRequestError` and never sent again, so a request that crashes
servers costs one error, not the fleet's restart budgets. A prompt naming a token id outside
`rollout.vocab_size` is refused before any server sees it (an id past the embedding ends an
SGLang scheduler). `sample` is one completion,
continued from the tokens it has after each abort of this client's own pause; `sample_group`
sends a prompt's samples as one request where the backend takes a batch, each sample then
continued alone if our pause aborted it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, cast

import aiohttp
import torch

from areal_like.api.config import RolloutConfig
from areal_like.api.io_struct import ModelRequest, ModelResponse, StopReason
from areal_like.api.trajectory import NO_EXPERT
from engines.fleet.coalescing import RequestCoalescer
from engines.fleet.membership import FleetMembership
from engines.fleet.routing import OwnAborts, ServerPool
from engines.server.api import ServerAPI
from engines.server.errors import (
    InferenceServerError,
    PoisonRequestError,
    RequestRejectedError,
    ServerProtocolError,
)
from engines.server.http import RETRYABLE as _RETRYABLE
from engines.server.http import RetryableHTTPError as _RetryableHTTPError
from engines.server.http import parse_json_reply
from engines.server.replies import GenerateReply, GroupReply, ScoreReply

logger = logging.getLogger("engines.fleet.client")

# A server that answers /generate with nonsense (impossible log-probabilities, missing fields)
# is treated like one that dropped the connection: the request goes to another server.
_GENERATE_RETRYABLE = (*_RETRYABLE, ServerProtocolError)
R = TypeVar("R", GenerateReply, GroupReply, ScoreReply)  # a /generate reply, parsed
DROPS_BEFORE_POISON = 2  # a request its servers dropped this often is not sent again


def _dropped_mid_request(e: BaseException) -> bool:
    """The server closed the connection while the request ran (it died, or was killed);
    not a refused connection (the request never reached it) nor a timeout (it hangs)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return False
    return isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                          aiohttp.ClientPayloadError))


def check_token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """Refuse ids outside the model's vocabulary before a server sees them (0: unchecked)."""
    if vocab_size <= 0 or not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise RequestRejectedError(f"{what}[{i}] = {t} is outside the model's vocabulary "
                               f"(0..{vocab_size - 1}, rollout.vocab_size)")


@dataclass
class _FirstSegment:
    """A sample's first reply, received with its group's (see `_generate_group`)."""

    addr: str
    reply: GenerateReply
    start: float  # when the group was sent
    ttft: float
    epoch: int  # of our own aborts, when the group was sent


class FleetRequests:
    """The requests of one `RemoteInferenceEngine` (see the module doc); runs on its loop."""

    def __init__(self, config: RolloutConfig, api: ServerAPI, servers: ServerPool,
                 membership: FleetMembership, own_aborts: OwnAborts,
                 session: Callable[[], aiohttp.ClientSession]) -> None:
        self.config, self.api, self.servers = config, api, servers
        self.membership, self._own_aborts, self._session = membership, own_aborts, session
        self._background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks alive
        window_s = config.client.batch_window_ms / 1000.0
        self.coalescer = (RequestCoalescer(api.group_payload, self._post_group, window_s)
                          if window_s > 0 and api.groups_in_one_request else None)

    async def _post_group(self, payload: dict[str, Any], route_key: str,
                          rids: list[str]) -> tuple[str, GroupReply]:
        return await self.post(payload, route_key, rids, self.api.parse_group_reply)

    def _named(self, req: ModelRequest, payload: dict[str, Any]) -> dict[str, Any]:
        return self.api.name_adapter(payload, req.lora_adapter) if req.lora_adapter else payload

    # ---- samples ------------------------------------------------------------------------
    async def sample(self, req: ModelRequest, route_key: str, rid: str,
                        seed: int) -> ModelResponse:
        check_token_ids(req.input_ids, self.config.vocab_size, "input_ids")
        # requests may share a rid (AReaL-lite's workflows do); the server needs distinct ids
        rid = self.servers.claim_rid(rid)
        try:
            return await self._segments(req, route_key, rid, seed)
        finally:
            self.servers.release_rid(rid)

    async def sample_group(self, req: ModelRequest, route_key: str,
                              seeds: list[int]) -> list[ModelResponse]:
        """One request for the samples of `req` (one seed each); a sample aborted by our pause
        continues alone, like any other request."""
        g = req.gconfig
        check_token_ids(req.input_ids, self.config.vocab_size, "input_ids")
        rids = [self.servers.claim_rid(f"{route_key}-{i}") for i in range(len(seeds))]
        try:
            start, epoch = time.monotonic(), self._own_aborts.epoch
            payloads = [self._named(req, self.api.generate_payload(
                            list(req.input_ids), g, rid, g.max_new_tokens, g.min_new_tokens,
                            seed=seed)) for rid, seed in zip(rids, seeds, strict=True)]
            if self.coalescer is not None:  # with other prompts' samples, as one request
                addr, replies = await self.coalescer.submit(payloads, route_key, rids)
            else:
                addr, group = await self.post(self.api.group_payload(payloads), route_key,
                                              rids, self.api.parse_group_reply)
                replies = group.replies
            ttft = time.monotonic() - start
            return list(await asyncio.gather(*(
                self._segments(req, route_key, rid, seed,
                                  _FirstSegment(addr, reply, start, ttft, epoch))
                for rid, seed, reply in zip(rids, seeds, replies, strict=True))))
        finally:
            for rid in rids:
                self.servers.release_rid(rid)

    async def _segments(self, req: ModelRequest, route_key: str, rid: str,
                           seed: int, first: Optional[_FirstSegment] = None) -> ModelResponse:
        """One sample, continued after each abort of our own pause; `first`: its first
        segment's reply, already received (a group's)."""
        g = req.gconfig
        start = time.monotonic() if first is None else first.start
        epoch = self._own_aborts.epoch if first is None else first.epoch
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ttft: Optional[float] = None if first is None else first.ttft
        segment = 0
        while True:
            # After an abort we continue from the tokens we have (a new rid: SGLang may still
            # be cleaning up the old one).
            seg_rid = rid if segment == 0 else f"{rid}#cont{segment}"
            if segment == 0 and first is not None:
                addr, reply = first.addr, first.reply
            else:
                payload = self.api.generate_payload(
                    list(req.input_ids) + tokens, g, seg_rid,
                    max_new_tokens=g.max_new_tokens - len(tokens),
                    min_new_tokens=max(0, g.min_new_tokens - len(tokens)),
                    seed=seed,  # a continuation draws what the uninterrupted request would have
                )
                payload = self._named(req, payload)
                if req.image_data:
                    payload = self.api.add_images(payload, req.image_data)
                if self.coalescer is not None and not req.image_data:
                    addr, (reply,) = await self.coalescer.submit([payload], route_key, [seg_rid])
                else:
                    addr, reply = await self.post(payload, route_key, seg_rid,
                                                  self.api.parse_generate_reply)
            if ttft is None:
                ttft = time.monotonic() - start
            tokens += reply.output_ids
            logprobs += reply.logprobs
            versions += reply.versions
            stop_reason = reply.stop_reason
            if stop_reason != "abort" or not self._own_aborts.ours(epoch):
                break  # a real abort (not caused by our pause) is reported as such
            epoch = self._own_aborts.epoch
            segment += 1
            if len(tokens) >= g.max_new_tokens:
                stop_reason = "length"
                break
        routed = None
        if self.api.routed_experts:  # the last segment forwarded every position before it
            routed = _routing_by_position(reply.routed_experts, len(req.input_ids) + len(tokens),
                                          f"server {addr}, rid={rid}")
        return ModelResponse(
            routed_experts=routed,
            input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs,
            output_versions=versions, stop_reason=cast(StopReason, stop_reason),  # checked there
            latency=time.monotonic() - start, ttft=ttft or 0.0, rid=rid,
            metadata={"server": addr, "segments": segment + 1,
                      "num_retractions": reply.meta_info.get("num_retractions", 0),
                      # the last segment's prompt as the server counted it (images expanded)
                      "prompt_tokens": reply.meta_info.get("prompt_tokens"),
                      # of it, taken from the server's prefix cache (SGLang; None elsewhere)
                      "cached_tokens": reply.meta_info.get("cached_tokens")},
        )

    # ---- posting, retried -------------------------------------------------------------
    async def post(
        self, payload: dict[str, Any], route_key: str, rid: str | list[str],
        parse: Callable[[Any, str, Any], R],
    ) -> tuple[str, R]:
        """Post `payload` (named `rid`, or a group's samples named `rids`) to a server in
        service, retried on another after a failure; `parse` checks the reply."""
        session = self._session()
        timeout = aiohttp.ClientTimeout(total=self.config.client.request_timeout)
        tried: list[str] = []
        dropped_by: list[str] = []  # the servers that dropped it mid-way
        last_error: BaseException | None = None
        for attempt in range(self.config.client.request_retries):
            addr = await self.membership.wait_in_service(route_key, frozenset(tried))
            floor = self.membership.served_version()  # what `addr` holds at least, now
            tried.append(addr)
            # A retry gets a fresh rid: the failed server may still hold the old one.
            sent_rid: str | list[str]
            if isinstance(rid, list):
                sent_rid = rid if attempt == 0 else [f"{r}#retry{attempt}" for r in rid]
                self.api.set_rids(payload, sent_rid)
            else:
                sent_rid = rid if attempt == 0 else f"{rid}#retry{attempt}"
                self.api.set_rid(payload, sent_rid)
            self.servers.inflight[addr] += 1
            try:
                path = self.api.generate_path
                async with session.post(f"http://{addr}{path}", json=payload,
                                        timeout=timeout) as resp:
                    if resp.status >= 500:
                        raise _RetryableHTTPError(resp.status, await resp.text())
                    lost = (self.api.lost_state(resp.status, await resp.text())
                            if resp.status != 200 else "")
                    if lost:  # restarted between requests: out, reloaded, then back
                        last_error = self.membership.lost_state(addr, lost)
                        continue
                    if resp.status != 200:
                        message = (f"{self.api.name} server {addr} rejected {path} "
                                   f"rid={sent_rid}: HTTP {resp.status}: "
                                   f"{(await resp.text())[:500]}")
                        if 400 <= resp.status < 500:
                            raise RequestRejectedError(message, resp.status)
                        raise InferenceServerError(message)
                    data = parse_json_reply(await resp.text(), addr, path)
                    reply = parse(data, addr, sent_rid)
                last_error = self.membership.lost_weights(addr, reply.versions, floor)
                if last_error is None:
                    return addr, reply
            except _GENERATE_RETRYABLE as e:
                if session.closed:  # this engine's destroy() closed it: no server is at fault
                    raise InferenceServerError(f"generate rid={sent_rid}: the engine was "
                                               f"destroyed while the request ran") from e
                last_error = e
                self.servers.mark_failed(addr)
                if _dropped_mid_request(e):
                    dropped_by.append(addr)
                if isinstance(e, aiohttp.ClientConnectorError):  # nothing listens: it is down
                    self.membership.take_out(addr, f"connection refused ({e})")
                elif isinstance(e, (aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                    self.membership.check_soon(addr, e)  # dead or hung: out of service
                logger.warning("%s server %s failed rid=%s (try %d/%d): %s: %s", self.api.name,
                               addr, sent_rid, attempt + 1, self.config.client.request_retries,
                               type(e).__name__,
                               str(e) or f"no reply within {self.config.client.request_timeout} s")
                if isinstance(e, asyncio.TimeoutError):
                    for name in sent_rid if isinstance(sent_rid, list) else [sent_rid]:
                        self._abort_later(addr, name)
                if len(dropped_by) >= DROPS_BEFORE_POISON:
                    raise PoisonRequestError(
                        f"{self.api.generate_path} rid={rid}: its server dropped it mid-way "
                        f"{len(dropped_by)} times ({', '.join(dropped_by)}; last: "
                        f"{type(e).__name__}: {e}); the request is taken to be the cause and is "
                        f"not sent again") from e
                if attempt + 1 < self.config.client.request_retries:
                    await asyncio.sleep(self.config.client.retry_backoff * 2**attempt)
            finally:
                if addr in self.servers.inflight:  # else drained and removed meanwhile
                    self.servers.inflight[addr] -= 1
        cause = (f"timed out after {self.config.client.request_timeout} s (RolloutConfig."
                 f"request_timeout)" if isinstance(last_error, asyncio.TimeoutError)
                 else f"{type(last_error).__name__}: {last_error}")
        raise InferenceServerError(
            f"{self.api.generate_path} rid={rid} failed after {len(tried)} tries (servers "
            f"tried: {tried}); last error from {self.api.name} server {tried[-1]}: {cause}"
        ) from last_error

    def _abort_later(self, addr: str, rid: str) -> None:
        """Best effort: stop a timed-out request from burning the server's compute."""

        async def abort() -> None:
            try:
                await self.api.abort(self._session(), addr, rid)
            except (InferenceServerError, *_RETRYABLE) as e:
                logger.warning("could not abort rid=%s on %s: %s", rid, addr, e)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _routing_by_position(flat: Optional[torch.Tensor], n_positions: int,
                         where: str) -> torch.Tensor:
    """[n_positions, n_moe_layers * top_k] int16 from the server's flat record of the
    positions it forwarded (all but the last, which gets NO_EXPERT)."""
    rows = n_positions - 1
    if flat is None or rows < 1 or flat.numel() % rows or flat.numel() == 0:
        got = None if flat is None else flat.numel()
        raise ServerProtocolError(f"{where}: meta_info.routed_experts holds {got} expert ids "
                                  f"for the {rows} positions the server forwarded; expected "
                                  f"a whole number of ids per position")
    table = flat.reshape(rows, -1).to(torch.int16)
    return torch.cat([table, table.new_full((1, table.shape[1]), NO_EXPERT)])
