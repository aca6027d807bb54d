"""Samples asked for at nearly the same moment go to a server as one request.

A step's episodes are admitted together (when the weights' version moves) and each asks for
its prompt's samples at once: sixteen groups, sixteen HTTP requests, sixteen passes through
the server's HTTP front end and tokenizer manager, sixteen replies parsed. Where the backend
takes a batch (SGLang), `RequestCoalescer` holds a request for `window_s` (a few
milliseconds) and sends every request of the same kind that arrived meanwhile as one batched
`/generate`, each sample still with its own rid and seed, so the server computes exactly what
the separate requests would have (`rollout.client.batch_window_ms`). The merged request is
posted, retried and checked as one (`FleetRequests.post`); each waiter gets its own samples'
replies, or the error that ended the merged request.

Requests merge only when their keys, whole-request flags and sampling parameters agree (all
but the seed and the token budget: a greedy request beside sampled ones in one batch changed
what SGLang's sampler drew for the sampled ones); one that asks for images goes alone. A
waiter cancelled before the reply leaves its samples running on the server (their results
are dropped).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Callable

from engines.server.replies import GenerateReply, GroupReply

# posts one batched payload named by `rids` under `route_key`: (server, the parsed replies)
PostBatch = Callable[[dict[str, Any], str, list[str]], Awaitable[tuple[str, GroupReply]]]


@dataclass
class _Waiter:
    payloads: list[dict[str, Any]]
    rids: list[str]
    future: asyncio.Future[tuple[str, list[GenerateReply]]]


@dataclass
class _Batch:
    route_key: str  # the first waiter's: where the merged request is routed
    waiters: list[_Waiter] = field(default_factory=list)
    samples: int = 0


class RequestCoalescer:
    """Merges the payloads submitted within `window_s` of the first into one batched request
    (at most `max_samples` samples; a full batch goes at once). Runs on one event loop."""

    def __init__(self, group_payload: Callable[[list[dict[str, Any]]], dict[str, Any]],
                 post_batch: PostBatch, window_s: float, max_samples: int = 512) -> None:
        if window_s <= 0:
            raise ValueError(f"RequestCoalescer: window_s={window_s} must be > 0")
        self._group_payload, self._post_batch = group_payload, post_batch
        self.window_s, self.max_samples = window_s, max_samples
        self._open: dict[str, _Batch] = {}  # by the payloads' whole-request flags
        self._sent: set[asyncio.Task[None]] = set()  # keeps the merged requests alive
        self.requests = self.merged = 0  # posted, and of them how many held several waiters

    async def submit(self, payloads: list[dict[str, Any]], route_key: str,
                     rids: list[str]) -> tuple[str, list[GenerateReply]]:
        """Generate `payloads` (one per sample, named `rids`); returns the server and one
        reply per sample, in order."""
        loop = asyncio.get_running_loop()
        kind = _kind(payloads[0])
        batch = self._open.get(kind)
        if batch is None:
            batch = self._open[kind] = _Batch(route_key)
            loop.call_later(self.window_s, self._send, kind, batch)
        waiter = _Waiter(payloads, rids, loop.create_future())
        batch.waiters.append(waiter)
        batch.samples += len(payloads)
        if batch.samples >= self.max_samples:
            self._send(kind, batch)
        return await waiter.future

    def _send(self, kind: str, batch: _Batch) -> None:
        if self._open.get(kind) is not batch:
            return  # already sent (full before its window ended)
        del self._open[kind]
        task = asyncio.get_running_loop().create_task(self._post(batch))
        self._sent.add(task)
        task.add_done_callback(self._sent.discard)

    async def _post(self, batch: _Batch) -> None:
        self.requests += 1
        self.merged += len(batch.waiters) > 1
        payloads = [p for w in batch.waiters for p in w.payloads]
        rids = [r for w in batch.waiters for r in w.rids]
        try:
            addr, group = await self._post_batch(self._group_payload(payloads),
                                                 batch.route_key, rids)
        except BaseException as e:  # noqa: BLE001 - every waiter gets it, none is lost
            for w in batch.waiters:
                if not w.future.done():
                    w.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        start = 0
        for w in batch.waiters:
            replies = group.replies[start:start + len(w.payloads)]
            start += len(w.payloads)
            if not w.future.done():  # a cancelled waiter's samples are dropped
                w.future.set_result((addr, replies))


# sampling parameters a merged request's samples may differ in: the rest (temperature,
# top-k/p, stops, penalties) decides how the server's sampler treats the batch, so mixing them
# in one request (a greedy row beside sampled ones) could change what a sample draws
PER_SAMPLE_PARAMS = frozenset({"sampling_seed", "seed", "max_new_tokens"})


def _kind(payload: dict[str, Any]) -> str:
    """What must agree for payloads to share a request: the keys, the whole-request flags
    (the boolean entries: `return_logprob`, `stream`) and the sampling parameters but the
    per-sample ones (`PER_SAMPLE_PARAMS`); ids, rids and adapters' names go per sample."""
    flags = {k: v for k, v in payload.items() if isinstance(v, bool)}
    params = {k: v for k, v in (payload.get("sampling_params") or {}).items()
              if k not in PER_SAMPLE_PARAMS}
    return json.dumps([sorted(payload), flags, params], sort_keys=True, default=str)
