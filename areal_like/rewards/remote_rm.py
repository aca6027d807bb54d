"""A remote reward model: score decoded queries (prompt + completion text) over HTTP.

    reward.remote_rm_url=http://127.0.0.1:5000/get_reward     # replaces the task's verifier

Wire format (OpenRLHF's / LightRFT's `remote_rm_fn`): POST JSON
`{"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [answer, ...]}`,
answer `{"rewards": [float, ...]}` in the same order. `areal_like.rewards.rm_server` is such a
server.

Calls that arrive together (a group's samples are scored concurrently) are sent as one batch
of up to `batch_size` queries, after at most `batch_wait` seconds of collecting.

Timeouts measure the work, not the wait for it: the clock of a request starts when it is sent
(the collecting window and the caller's queueing do not count; requests never wait for a
connection slot) and stops when the server's answer has been read: `timeout` seconds per
request. A timed-out request is not retried (the server is slow or hung; resending would
multiply the stall); a connection error or an HTTP 5xx answer is retried `max_retries` times
after `retry_backoff` seconds. What is still failing then is a `RewardFailure` for every sample
of the batch, named `remote_rm(<url>)`: never a 0.0 - the rollout executor excludes and counts
it, and the error budget (reward.max_failure_rate) stops the run naming the URL. A sample
whose returned score is not a finite number fails alone ("invalid").
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import aiohttp

from areal_like.rewards.failures import RewardFailure
from areal_like.rewards.pool_worker import InvalidReward, coerce_reward

logger = logging.getLogger(__name__)

_Pending = tuple[str, str, Any, "asyncio.Future[float]"]


class _Retryable(Exception):
    pass


class RemoteRewardModel:
    """Client of one remote reward model; its reward function is the bound method `score`."""

    # RewardExecutor: this function bounds its own requests (see module doc), so the executor
    # starts no clock of its own that would count the batching window as work
    self_timed = True

    def __init__(self, url: str, timeout: float = 15.0, max_retries: int = 2,
                 batch_size: int = 8, batch_wait: float = 0.01, retry_backoff: float = 0.5,
                 label_key: str = "answer") -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.remote_rm_url={url!r} must be an http(s):// URL")
        for key, value, ok in (("timeout", timeout, timeout > 0),
                               ("remote_rm_max_retries", max_retries, max_retries >= 0),
                               ("remote_rm_batch_size", batch_size, batch_size >= 1),
                               ("batch_wait", batch_wait, batch_wait >= 0),
                               ("retry_backoff", retry_backoff, retry_backoff >= 0)):
            if not ok:
                raise ValueError(f"RemoteRewardModel: {key}={value!r} is out of range")
        self.url, self.timeout, self.max_retries = url, float(timeout), max_retries
        self.batch_size, self.batch_wait, self.retry_backoff = batch_size, batch_wait, retry_backoff
        self.label_key = label_key
        self.areal_reward_name = f"remote_rm({url})"  # names it in failures and metrics
        self._reset()

    def _reset(self) -> None:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._pending: list[_Pending] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __getstate__(self) -> dict[str, Any]:
        # sent to the rollout controller process: settings only, no session or loop
        state = self.__dict__.copy()
        for key in ("_loop", "_session", "_pending", "_timer", "_tasks"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def max_wait(self) -> float:
        """Upper bound of one `score` call: collecting, every attempt and every backoff."""
        return self.batch_wait + (self.max_retries + 1) * (self.timeout + self.retry_backoff) + 5

    # ---- the reward function -------------------------------------------------------------
    async def score(self, prompt: str, completion: str, **data: Any) -> float:
        """The remote model's score of `prompt + completion` (label: data[label_key])."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or a new event loop: its own session
            self._reset()
            self._loop = loop
        future: asyncio.Future[float] = loop.create_future()
        self._pending.append((prompt + completion, prompt, data.get(self.label_key), future))
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.batch_wait, self._flush)
        try:
            # the send task resolves every future within max_wait; the bound is a safety net
            return await asyncio.wait_for(asyncio.shield(future), self.max_wait)
        except asyncio.TimeoutError:
            raise RewardFailure(self.areal_reward_name, "timeout",
                                f"no score within {self.max_wait:.1f} s") from None

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            scores = await self._request(batch)
        except RewardFailure as failure:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        except BaseException as e:  # a bug here must reach every caller, not vanish
            for *_, future in batch:
                if not future.done():
                    future.set_exception(e)
            raise
        for (*_, future), value in zip(batch, scores, strict=True):
            if future.done():
                continue
            try:
                future.set_result(coerce_reward(value))
            except InvalidReward as e:
                future.set_exception(RewardFailure(self.areal_reward_name, "invalid",
                                                   f"score {e}"))

    async def _request(self, batch: list[_Pending]) -> list[Any]:
        payload = {"query": [q for q, *_ in batch], "prompts": [p for _, p, *_ in batch],
                   "labels": [lab for _, _, lab, _ in batch]}
        if self._session is None:
            # limit=0: no client-side queue for a connection, so a request's clock only
            # ever measures the server
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff)
            try:
                return await self._post_once(payload, len(batch))
            except _Retryable as e:
                last = str(e)
                logger.warning("remote RM %s, attempt %d of %d: %s", self.url, attempt + 1,
                               self.max_retries + 1, last)
        raise RewardFailure(self.areal_reward_name, "raised",
                            f"{last} (after {self.max_retries + 1} attempts)")

    async def _post_once(self, payload: dict[str, Any], n: int) -> list[Any]:
        assert self._session is not None
        name = self.areal_reward_name
        session = self._session

        async def post() -> tuple[int, str]:
            async with session.post(self.url, json=payload) as resp:
                return resp.status, await resp.text()

        try:  # the clock runs from sending to the answer read
            status, body = await asyncio.wait_for(post(), self.timeout)
        except asyncio.TimeoutError:
            raise RewardFailure(name, "timeout", f"no answer to a batch of {n} queries within "
                                f"reward.timeout={self.timeout} s of sending it") from None
        except aiohttp.ClientError as e:
            raise _Retryable(f"cannot reach {self.url} (reward.remote_rm_url): "
                             f"{type(e).__name__}: {e}") from None
        if status >= 500:
            raise _Retryable(f"HTTP {status} from {self.url}: {body[:200]}")
        if status != 200:
            raise RewardFailure(name, "raised", f"HTTP {status}: {body[:200]}")
        try:
            scores = json.loads(body)["rewards"]
        except (ValueError, KeyError, TypeError) as e:
            raise RewardFailure(name, "invalid", f"answer is not JSON with 'rewards' "
                                f"({type(e).__name__}: {e}): {body[:200]}") from None
        if not isinstance(scores, list) or len(scores) != n:
            raise RewardFailure(name, "invalid", f"'rewards' must be a list of {n} numbers, "
                                f"got {str(scores)[:200]}")
        return scores

    async def aclose(self) -> None:
        """Close the HTTP session (on the loop that used it)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def remote_reward_fn(config: Any) -> Any:
    """The reward function of `RewardConfig.remote_rm_url` (a bound `score`)."""
    return RemoteRewardModel(config.remote_rm_url, timeout=config.timeout,
                             max_retries=config.remote_rm_max_retries,
                             batch_size=config.remote_rm_batch_size).score
