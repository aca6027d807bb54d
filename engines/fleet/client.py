"""RemoteInferenceEngine: the HTTP client of a fleet of inference servers, SGLang or vLLM
(`rollout.backend`; a thin InferenceEngine). `RemoteSGLangEngine` and `RemoteVLLMEngine` fix
the backend.

It generates, scores given tokens, pauses, resumes and loads weights; workflows run elsewhere.
What differs between backends is one `engines.server.api.ServerAPI` (the HTTP calls); routing,
retries, fleet membership and the weight transport below are shared.

Threading model. All HTTP traffic goes through one `aiohttp.ClientSession`, which belongs to
the event loop it was created on: the loop thread given to `initialize` (the rollout
controller's, where episodes run and call `agenerate` directly), or one the engine starts for
itself. `agenerate` awaited on any other loop (a script's `asyncio.run`, a test) is forwarded
to that loop and awaited there, so the session is never touched from a foreign loop.
Synchronous callers use `update_weights`, `pause`, `resume`, which run their async twins
(`aupdate_weights`, `apause`, `aresume`) on the loop and block, bounded by timeouts; calling a
sync method from the loop itself raises (it would deadlock) — await the async twin there.

Requests: `agenerate(req)` generates one sample (`req.gconfig.n_samples` must be 1);
`agenerate_n(req)` samples `n_samples` concurrently (one batched request where the backend
takes one) and returns a list. Servers are
chosen by fewest in-flight requests (or round robin), sticky by `rid`, so a multi-turn
conversation that reuses its rid hits the server that holds its prefix cache. Connection errors,
timeouts, HTTP 5xx, malformed JSON and impossible replies are retried with exponential backoff,
on another server when one exists; after `request_retries` tries the error names the server
and the cause. A server that stops answering leaves service (no request or weight update goes
to it) and comes back only after loading the current weights (`engines/fleet/membership.py`);
while no server is in service, requests wait for one up to `server_down_timeout` s, and past
that every `watch_fleet` callback gets the error. Every token's version is the one the
server reports (SGLang's `meta_info.weight_versions`, vLLM's `weight_versions` spans), not a
client-side guess; a reply older
than the weights its server held when the request was sent (the server restarted between
requests) is retried elsewhere while that server reloads the current weights. If a request is
aborted because this engine paused the fleet in a mode that aborts (SGLang's "abort"; every
vLLM pause but "in_place"), it is continued from the tokens it already has once generation
resumes, so callers never see that abort.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, Callable, Optional, TypeVar

import aiohttp

from areal_like.api.config import RolloutConfig
from areal_like.api.engine_api import InferenceEngine
from areal_like.api.io_struct import (
    FleetView,
    ModelRequest,
    ModelResponse,
    TokenScores,
    UpdateReport,
    WeightUpdateMeta,
)
from areal_like.api.seeding import derive_seed, request_seed
from areal_like.utils.loop_thread import EventLoopThread
from engines.fleet.backends import server_api
from engines.fleet.membership import FleetMembership
from engines.fleet.requests import FleetRequests, check_token_ids
from engines.fleet.routing import OwnAborts, ServerPool
from engines.server.api import ServerAPI
from engines.server.errors import InferenceServerError
from engines.server.http import (
    CONTROL_TIMEOUT_S,
    MalformedReplyError,
    open_session,
)
from engines.server.replies import ScoreReply

__all__ = ["MalformedReplyError", "RemoteInferenceEngine", "RemoteSGLangEngine",
           "InferenceServerError", "RemoteVLLMEngine"]

logger = logging.getLogger(__name__)

_NOT_INITIALIZED = "the inference engine is not initialized: call initialize() first"
T = TypeVar("T")


class RemoteInferenceEngine(InferenceEngine):
    """Client of a fleet (`config.server_addrs`, or `addresses`) of `config.backend`
    servers ("" = sglang), see module doc."""

    backend: Optional[str] = None  # set by the subclasses that fix it

    def __init__(self, config: RolloutConfig, addresses: Optional[list[str]] = None) -> None:
        self.config = config
        self.api: ServerAPI = server_api(self.backend or config.backend or "sglang",
                                         config.lora_adapter, config.return_routed_experts)
        self.addresses = list(addresses if addresses is not None else config.server_addrs)
        if not self.addresses:
            raise ValueError(f"{type(self).__name__}: no server addresses (RolloutConfig."
                             "server_addrs is empty and no `addresses` were given)")
        if config.health.min_servers > len(self.addresses):
            raise ValueError(f"rollout.health.min_servers={config.health.min_servers} but the "
                             f"fleet has {len(self.addresses)} server(s): {self.addresses}")
        self._loop_thread: Optional[EventLoopThread] = None
        self._owns_loop = False
        # called with the error when no server came back within server_down_timeout
        self._on_fleet_failure: list[Callable[[BaseException], None]] = []
        self._session: Optional[aiohttp.ClientSession] = None
        self._version = 0
        self._updating_to: Optional[int] = None  # a driven update's version, begun not ended
        self._version_lock = threading.Lock()
        # touched by the rollout loop only
        self.servers = ServerPool(self.addresses, config.client.schedule_policy)
        self._own_aborts = OwnAborts()  # this engine's pauses that abort: continued
        self.membership = FleetMembership(config, self.servers, self._require_session,
                                          self._fail, self.api, self._own_aborts)
        self.requests = FleetRequests(config, self.api, self.servers, self.membership,
                                      self._own_aborts, self._require_session)

    # ---- lifecycle ----------------------------------------------------------------------
    def initialize(
        self, loop_thread: Optional[EventLoopThread] = None, check_health: bool = True
    ) -> None:
        """Open the HTTP session on `loop_thread` (default: a loop thread of the engine's own)
        and (unless `check_health=False`) wait up to `config.client.setup_timeout` s until every
        server answers `/health`."""
        if self._session is not None:
            return
        if loop_thread is None:
            loop_thread, self._owns_loop = EventLoopThread("sglang-client"), True
            loop_thread.start()
        self._loop_thread = loop_thread
        try:
            loop_thread.run_coroutine(self._open_session(), timeout=CONTROL_TIMEOUT_S)
            if check_health:
                setup_timeout = self.config.client.setup_timeout
                loop_thread.run_coroutine(self.await_healthy(setup_timeout),
                                          timeout=setup_timeout + CONTROL_TIMEOUT_S)
            loop_thread.run_coroutine(self._start_watch(), timeout=CONTROL_TIMEOUT_S)
        except BaseException:
            self.destroy()
            raise

    async def _start_watch(self) -> None:
        self.membership.start()

    def watch_fleet(self, on_failure: Callable[[BaseException], None]) -> None:
        self._on_fleet_failure.append(on_failure)

    def _fail(self, error: BaseException) -> None:
        logger.error("%s", error)
        for callback in self._on_fleet_failure:
            callback(error)

    async def _open_session(self) -> None:
        self._session = open_session(self.config.client.api_key)

    def destroy(self) -> None:
        """Close the session and, if the engine started it, its loop thread. Safe to call
        twice; allowed after the fleet failed (clean-up still runs on the loop)."""
        loop_thread, self._loop_thread = self._loop_thread, None
        if loop_thread is None:
            return
        try:
            if self._session is not None:
                loop_thread.run_coroutine(self.membership.stop(), timeout=CONTROL_TIMEOUT_S)
                session, self._session = self._session, None
                loop_thread.run_coroutine(session.close(), timeout=CONTROL_TIMEOUT_S)
        finally:
            if self._owns_loop:
                loop_thread.stop()

    async def await_healthy(self, timeout: float) -> None:
        """Until every server is healthy (error after `timeout` s); a server left paused (by
        a client that died mid-update) is continued."""
        await self.membership.await_healthy(self.addresses, timeout)

    # ---- loop plumbing ------------------------------------------------------------------
    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return self._session

    def _loop_for(self, coro: Coroutine[Any, Any, Any]) -> EventLoopThread:
        """The rollout loop's thread (RuntimeError, `coro` closed, before initialize())."""
        if self._loop_thread is None:
            coro.close()
            raise RuntimeError(_NOT_INITIALIZED)
        return self._loop_thread

    def run_coroutine(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the engine's loop from another thread (TimeoutError after
        `timeout` s), e.g. `engine.run_coroutine(engine.agenerate(req), 60)`; from the loop
        itself it raises (await the coroutine there instead)."""
        return self._loop_for(coro).run_coroutine(coro, timeout)

    async def _on_rollout_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the rollout loop, wherever we are called from."""
        return await self._loop_for(coro).run_here(coro)

    # ---- generation ---------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One completion of `req` (token ids in, token ids + logprobs + versions out)."""
        if req.gconfig.n_samples != 1:
            raise ValueError(
                f"agenerate generates one sample but req.gconfig.n_samples="
                f"{req.gconfig.n_samples}; use agenerate_n(req) for a list of samples"
            )
        seed = request_seed(req)  # before any await: the order of calls fixes the seeds
        return await self._on_rollout_loop(
            self.requests.sample(req, route_key=req.rid, rid=req.rid, seed=seed))

    async def agenerate_n(self, req: ModelRequest) -> list[ModelResponse]:
        """`req.gconfig.n_samples` completions, sampled concurrently on the server `req.rid` is
        sticky to (they share the prompt's prefix cache); sample i has rid `<rid>-<i>`. Where
        the backend takes a batch (SGLang) and the prompt has no images, the samples go as one
        request, each with its own rid and seed: one round trip instead of n."""
        n = req.gconfig.n_samples
        one = req.gconfig.new(n_samples=1)
        seeds = ([derive_seed(req.seed, i) for i in range(n)] if req.seed is not None
                 else [request_seed(req) for _ in range(n)])
        if n > 1 and self.api.groups_in_one_request and not req.image_data:
            return await self._on_rollout_loop(
                self.requests.sample_group(req.copy(gconfig=one), req.rid, seeds))
        coros = [self.requests.sample(req.copy(gconfig=one), route_key=req.rid,
                                      rid=f"{req.rid}-{i}", seed=seeds[i])
                 for i in range(n)]

        async def fan_out() -> list[ModelResponse]:
            return list(await asyncio.gather(*coros))

        return await self._on_rollout_loop(fan_out())

    # ---- scoring ------------------------------------------------------------
    async def ascore_batch(self, sequences: list[list[int]], starts: list[int],
                           rid: str = "score", lora_adapter: str = "") -> list[list[float]]:
        """One prefill batch on one server (nothing sampled; one request where the backend takes
        a batch, else one each, concurrently); routed, retried and checked like generation.
        `lora_adapter`: as `ModelRequest.lora_adapter`."""
        return [s.logprobs for s in await self.ascore_top_batch(sequences, starts, 0, rid,
                                                                lora_adapter)]

    async def ascore_top_batch(self, sequences: list[list[int]], starts: list[int], top_k: int,
                               rid: str = "score", lora_adapter: str = "") -> list[TokenScores]:
        """`ascore_batch`, and at every scored position the `top_k` most likely tokens."""
        if len(sequences) != len(starts) or not sequences:
            raise ValueError(f"score: {len(sequences)} sequences and {len(starts)} starts; "
                             f"expected as many, at least one")
        for j, seq in enumerate(sequences):
            check_token_ids(list(seq), self.config.vocab_size, f"sequences[{j}]")
        batches = ([(list(range(len(sequences))), rid)] if self.api.scores_in_one_request
                   else [([i], f"{rid}_{i}") for i in range(len(sequences))])

        async def score(indices: list[int], name: str) -> list[TokenScores]:
            seqs, firsts = [list(sequences[i]) for i in indices], [starts[i] for i in indices]
            payload = self.api.score_payload(seqs, firsts, name, top_k)
            if lora_adapter:
                payload = self.api.name_adapter(payload, lora_adapter)

            def parse(data: Any, addr: str, sent_rid: str) -> ScoreReply:
                return self.api.parse_score_reply(data, addr, sent_rid, seqs, firsts, top_k)

            claimed = self.servers.claim_rid(name)
            try:
                _, reply = await self.requests.post(payload, rid, claimed, parse)
            finally:
                self.servers.release_rid(claimed)
            return reply.scores

        async def score_all() -> list[TokenScores]:
            parts = await asyncio.gather(*(score(ix, name) for ix, name in batches))
            return [lps for part in parts for lps in part]

        return await self._on_rollout_loop(score_all())

    # ---- control calls ------------------------------------------------------------------
    async def _pause_servers(self, mode: str) -> None:
        with self._own_aborts.pause(aborts=self.api.aborts_on_pause(mode)):
            await self.membership.pause_all(mode)

    async def apause(self) -> None:
        """Pause generation on every server (`config.client.pause_mode`)."""
        await self._on_rollout_loop(self._pause_servers(self.config.client.pause_mode))

    async def aresume(self) -> None:
        await self._on_rollout_loop(self.membership.continue_all())

    def pause(self) -> None:
        self.run_coroutine(self.apause(), 2 * CONTROL_TIMEOUT_S)

    def resume(self) -> None:
        self.run_coroutine(self.aresume(), 2 * CONTROL_TIMEOUT_S)

    async def aupdate_weights(self, meta: WeightUpdateMeta) -> None:
        """On every server in service, each on its own: pause (retract: in-flight requests
        are kept; a LoRA fleet aborts and continues them), load `meta` (a folder, or a LoRA
        adapter in memory) labelled `meta.version`, continue (always, in a `finally`).
        Requests in flight finish, their tokens carrying both versions. Each step is bounded
        by `config.weights.update_timeout`; a server that fails leaves service, and the call
        raises only when every server failed."""
        if meta.driven_by_trainer:
            raise ValueError(f"WeightUpdateMeta(type={meta.type!r}) is not loaded in one call: "
                             "see areal_like.runtime.weight_sync.push_weights")
        await self._on_rollout_loop(self._update_per_server(meta))

    async def _update_per_server(self, meta: WeightUpdateMeta) -> None:
        await self.membership.update_all(meta)  # per server: pause -> load -> continue
        self.set_version(meta.version)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        # twice: it may first wait for a server's readmission (itself a load) to finish
        self.run_coroutine(self.aupdate_weights(meta),
                           2 * self.config.weights.update_timeout + 4 * CONTROL_TIMEOUT_S)

    # ---- updates trainer rank 0 drives (engines/fleet/updater.py) ------------------------
    def begin_weight_update(self, version: int, pause_mode: str) -> FleetView:
        # held at most as long as the longest update (disk: two loads; distributed: a new
        # group's formation and a broadcast), then released with the servers taken out
        timeout = self.config.weights.update_timeout
        expires = 3 * timeout + self.config.weights.broadcast_timeout + 4 * CONTROL_TIMEOUT_S
        view = self.run_coroutine(self._on_rollout_loop(
            self.membership.hold_for_update(version, pause_mode, expires)),
            timeout + CONTROL_TIMEOUT_S)
        with self._version_lock:
            self._updating_to = int(version)
        return view

    def end_weight_update(self, report: UpdateReport) -> None:
        async def end() -> None:
            if self.membership.end_update(report) and report.advanced:
                self.set_version(report.meta.version)

        try:
            self.run_coroutine(self._on_rollout_loop(end()), CONTROL_TIMEOUT_S)
        finally:
            with self._version_lock:
                self._updating_to = None

    def set_version(self, version: int) -> None:
        with self._version_lock:
            self._version = int(version)

    def get_version(self) -> int:
        with self._version_lock:
            return self._version

    def trainer_version(self) -> int:
        with self._version_lock:
            return max(self._version, self._updating_to or 0)

    def inflight(self) -> dict[str, int]:  # per server, a snapshot
        return dict(self.servers.inflight)

    def in_service(self) -> list[str]:  # the servers that get requests and updates now
        return self.servers.in_service()

    def add_server(self, addr: str) -> None:
        """Add a server to a running fleet: it loads the current weights and version, then
        takes traffic (within `health.check_interval` s of answering)."""
        if self._loop_thread is None:
            raise RuntimeError(_NOT_INITIALIZED)
        self._loop_thread.call_soon(self.servers.add, addr, "new: loading the current weights")

    def fleet_stats(self) -> dict[str, float]:
        """Servers in service, and how many times servers left, came back or joined (with
        `rollout.client.batch_window_ms`: the batched requests sent, and those that merged)."""
        stats = {f"fleet/{k}": float(v) for k, v in self.membership.stats().items()}
        coalescer = self.requests.coalescer
        if coalescer is not None:
            stats |= {"fleet/batched_requests_total": float(coalescer.requests),
                      "fleet/merged_requests_total": float(coalescer.merged)}
        return stats


class RemoteSGLangEngine(RemoteInferenceEngine):
    """Client of an SGLang fleet (whatever `config.backend` says)."""

    backend = "sglang"


class RemoteVLLMEngine(RemoteInferenceEngine):
    """Client of a vLLM fleet (whatever `config.backend` says)."""

    backend = "vllm"
