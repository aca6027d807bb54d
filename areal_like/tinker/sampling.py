"""Sampling for the Tinker API through our SGLang fleet: each sampler checkpoint (a PEFT
adapter folder `save_weights_for_sampler` wrote) is loaded on every server under a name of its
own, and a sample names it per request (`ModelRequest.lora_adapter`), so one fleet serves the
base model and any number of checkpoints side by side. At most `max_loaded` adapters stay
loaded: the least recently used one that no request holds is unloaded, and loaded again from
its folder when it is sampled from again."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
import numpy as np

from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest
from areal_like.api.rollout_config import RolloutConfig
from areal_like.tinker import fields
from areal_like.tinker.errors import UserError
from areal_like.tinker.wire import SampledSequence, encode_sample_response
from engines.fleet.client import RemoteInferenceEngine
from engines.server.errors import InferenceServerError, RequestRejectedError
from engines.server.http import post_json
from engines.sglang.lora_api import loaded_adapters

logger = logging.getLogger(__name__)
ADAPTER_LOAD_TIMEOUT_S = 300.0


@dataclass
class SamplingParams:
    """`sampling_params` of an asample request, checked."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_strings: list[str]
    stop_tokens: list[int]
    seed: Optional[int]

    @classmethod
    def parse(cls, raw: dict[str, Any], default_max_tokens: int,
              context_length: int) -> SamplingParams:
        stop = raw.get("stop")
        items = [] if stop is None else ([stop] if isinstance(stop, (str, int)) else stop)
        if not isinstance(items, list):
            raise UserError(f"sampling_params.stop={stop!r}: expected strings or token ids")
        strings = [s for s in items if isinstance(s, str)]
        tokens = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
        if len(strings) + len(tokens) != len(items):
            raise UserError(f"sampling_params.stop={stop!r}: expected strings or token ids")
        seed = raw.get("seed")
        params = cls(
            max_tokens=fields.integer(raw, "sampling_params.max_tokens", default_max_tokens,
                                      low=1, high=context_length),
            temperature=fields.number(raw, "sampling_params.temperature", 1.0),
            top_p=fields.number(raw, "sampling_params.top_p", 1.0),
            top_k=fields.integer(raw, "sampling_params.top_k", -1),
            stop_strings=strings, stop_tokens=tokens,
            seed=None if seed is None else fields.integer(raw, "sampling_params.seed",
                                                           low=-2**63, high=2**63 - 1))
        try:
            params.gconfig(1)
        except ValueError as e:
            raise UserError(f"sampling_params: {e}") from e
        return params

    def gconfig(self, n: int) -> GenerationHyperparameters:
        return GenerationHyperparameters(
            n_samples=n, max_new_tokens=self.max_tokens, temperature=self.temperature,
            greedy=self.temperature == 0.0, top_p=self.top_p, top_k=self.top_k,
            stop=self.stop_strings, stop_token_ids=self.stop_tokens)


@dataclass
class _Adapter:
    name: str  # as the servers hold it
    folder: str
    loaded: bool = False
    in_use: int = 0
    last_used: float = 0.0


class FleetSampler:
    """The fleet client and the adapters loaded on its servers."""

    def __init__(self, addresses: list[str], api_key: Optional[str], context_length: int,
                 max_loaded: int = 8) -> None:
        config = RolloutConfig(server_addrs=list(addresses))
        config.client = dataclasses.replace(config.client, api_key=api_key)
        self.engine = RemoteInferenceEngine(config)
        self.addresses, self.api_key = list(addresses), api_key
        self.context_length, self.max_loaded = context_length, max_loaded
        self.adapters: dict[str, _Adapter] = {}  # by the sampler checkpoint's tinker path
        self._lock = asyncio.Lock()  # loads and unloads one at a time
        self._counter = 0

    def start(self) -> None:
        self.engine.initialize()

    def stop(self) -> None:
        self.engine.destroy()

    def register(self, path: str, folder: str) -> None:
        """A sampler checkpoint (loaded on the servers when first sampled from)."""
        if path not in self.adapters:
            self._counter += 1
            self.adapters[path] = _Adapter(name=f"tinker-{self._counter}", folder=folder)

    async def replace(self, path: str, folder: str) -> None:
        """A checkpoint saved now (under a name that may have been saved before: the old
        adapter leaves the servers, the new one gets a name of its own)."""
        await self.forget(path)
        self.register(path, folder)

    async def forget(self, path: str) -> None:
        adapter = self.adapters.pop(path, None)
        if adapter is not None and adapter.loaded:
            async with self._lock:
                await self._on_servers("/unload_lora_adapter", {"lora_name": adapter.name})

    async def sample(self, path: Optional[str], prompt: list[int], n: int,
                     params: SamplingParams, prompt_logprobs: bool, topk_prompt: int) -> bytes:
        """The SDK's SampleResponse for `n` samples of `prompt` (from the checkpoint at
        `path`, or the base model when None)."""
        if len(prompt) + params.max_tokens > self.context_length:
            raise UserError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} "
                            f"exceeds the served context length {self.context_length}")
        adapter = await self._hold(path) if path else None
        try:
            name = adapter.name if adapter else ""
            request = ModelRequest(input_ids=list(prompt), gconfig=params.gconfig(n),
                                   seed=params.seed, lora_adapter=name)
            try:
                replies = await self.engine.agenerate_n(request)
            except InferenceServerError as e:
                if isinstance(e, RequestRejectedError) and not (name and _lost_adapter(str(e))):
                    raise UserError(f"the inference server refused this sample: {e}") from e
                if not name or not _lost_adapter(str(e)):
                    raise
                # a server restarted since the adapters were loaded: load them again
                logger.warning("a server lacks adapter %s (restarted?): %s", name, e)
                await self._reload_lost()
                replies = await self.engine.agenerate_n(request)
            sequences = [SampledSequence(r.output_tokens, r.output_logprobs,
                                         stopped=r.stop_reason == "stop") for r in replies]
            scored: Optional[list[float]] = None
            top: Optional[tuple[np.ndarray, np.ndarray]] = None
            if (prompt_logprobs or topk_prompt) and len(prompt) > 1:
                scores = (await self.engine.ascore_top_batch(
                    [list(prompt)], [1], topk_prompt, lora_adapter=name))[0]
                scored = [float("nan")] + list(scores.logprobs)
                if topk_prompt:
                    top = _topk_table(scores, len(prompt), topk_prompt)
            elif prompt_logprobs or topk_prompt:
                scored = [float("nan")]
            return encode_sample_response(sequences, scored if prompt_logprobs else None, top)
        finally:
            if adapter is not None:
                adapter.in_use -= 1

    async def _hold(self, path: str) -> _Adapter:
        adapter = self.adapters.get(path)
        if adapter is None:
            raise UserError(f"no sampler checkpoint {path!r} on this server")
        adapter.in_use += 1
        adapter.last_used = time.monotonic()
        if not adapter.loaded:
            try:
                async with self._lock:
                    await self._make_room()
                    if not adapter.loaded:
                        await self._on_servers("/load_lora_adapter", {
                            "lora_name": adapter.name, "lora_path": adapter.folder})
                        adapter.loaded = True
            except BaseException:
                adapter.in_use -= 1
                raise
        return adapter

    async def _reload_lost(self) -> None:
        """Load on each server the adapters it should hold and lacks."""
        async with self._lock, self._session() as session:
            for addr in self.addresses:
                held = set(await loaded_adapters(session, addr))
                for adapter in self.adapters.values():
                    if adapter.loaded and adapter.name not in held:
                        reply = await post_json(session, addr, "/load_lora_adapter", {
                            "lora_name": adapter.name, "lora_path": adapter.folder},
                            ADAPTER_LOAD_TIMEOUT_S, retries=0)
                        _check(reply, addr, adapter.name)

    def _session(self) -> aiohttp.ClientSession:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return aiohttp.ClientSession(headers=headers)

    async def _make_room(self) -> None:
        loaded = [a for a in self.adapters.values() if a.loaded]
        idle = sorted((a for a in loaded if a.in_use == 0), key=lambda a: a.last_used)
        for adapter in idle[:max(0, len(loaded) - self.max_loaded + 1)]:
            if adapter.in_use:  # taken since (by a request that found it loaded)
                continue
            adapter.loaded = False  # first: a request taking it now waits for the lock
            await self._on_servers("/unload_lora_adapter", {"lora_name": adapter.name})

    async def _on_servers(self, path: str, body: dict[str, Any]) -> None:
        async with self._session() as session:
            replies = await asyncio.gather(*(
                post_json(session, addr, path, body, ADAPTER_LOAD_TIMEOUT_S, retries=0)
                for addr in self.addresses))
        for addr, reply in zip(self.addresses, replies, strict=True):
            _check(reply, addr, f"{path} {body.get('lora_name')!r}")


def _check(reply: Any, addr: str, what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise InferenceServerError(f"server {addr}: {what} failed: "
                                   f"{reply.get('error_message') or reply}")


def _lost_adapter(message: str) -> bool:
    """SGLang's refusal of a request naming an adapter it does not hold."""
    return "never been loaded" in message or "are not loaded" in message


def _topk_table(scores: Any, length: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[length, k] ids and log-probs (position 0 has none: ids 0, log-prob -99999)."""
    ids = np.zeros((length, k), dtype=np.int32)
    lps = np.full((length, k), -99999.0, dtype=np.float32)
    for pos, (top_ids, top_lps) in enumerate(zip(scores.top_ids, scores.top_logprobs,
                                                 strict=True), start=1):
        ids[pos, :len(top_ids)] = top_ids
        lps[pos, :len(top_lps)] = top_lps
    return ids, lps
