"""Client of the PRM service: step scores over HTTP, under the reward-failure rules.

A call that times out, cannot connect, gets a non-200 answer or a malformed / non-finite
score list raises `RewardFailure` naming the URL — never a default score. Every call is
counted by a `RewardExecutor` (stats and error budget, reward name `prm@host:port`): past the
budget `RewardBudgetExceeded` stops the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.parse
from typing import Any, Optional

import aiohttp

from areal_like.rewards.failures import RewardFailure
from areal_like.rewards.reward_executor import RewardExecutor, episode_rewards


class PRMClient:
    """`await client.score(prompt, steps)` -> one float per step. Picklable (the aiohttp
    session is made per event loop, on first use)."""

    def __init__(self, url: str, timeout: float = 30.0,
                 executor: Optional[RewardExecutor] = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"prm.url={url!r}: expected http://host:port")
        if timeout <= 0:
            raise ValueError(f"prm.timeout={timeout}: expected > 0")
        self.url, self.timeout = url.rstrip("/"), timeout
        self._executor = executor
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    @property
    def name(self) -> str:
        """The reward name in stats and errors: `prm@host:port` (metric keys stay plain)."""
        return "prm@" + urllib.parse.urlsplit(self.url).netloc

    @property
    def executor(self) -> RewardExecutor:
        return self._executor or episode_rewards()  # its own, else the episode's

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "timeout": self.timeout, "_executor": self._executor,
                "_sessions": {}}

    def _session(self) -> aiohttp.ClientSession:
        key = id(asyncio.get_running_loop())
        if key not in self._sessions or self._sessions[key].closed:
            self._sessions[key] = aiohttp.ClientSession()
        return self._sessions[key]

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            await s.close()

    async def score(self, prompt: str, steps: list[str],
                    images: Optional[list[str]] = None) -> list[float]:
        """Scores of `steps` (with the prompt's `images` as base64 strings, for a PRM that
        sees them); raises RewardFailure (counted) on any failure."""
        try:
            scores = await self._request(prompt, steps, images or [])
        except RewardFailure as failure:
            self.executor.record(self.name, failure)  # may raise RewardBudgetExceeded
            raise
        self.executor.record(self.name, None)
        return scores

    async def _request(self, prompt: str, steps: list[str], images: list[str]) -> list[float]:
        body: dict[str, Any] = {"prompt": prompt, "steps": steps}
        if images:
            body["images"] = images
        try:
            async with self._session().post(
                    f"{self.url}/score", json=body,
                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                text = await resp.text()
                status = resp.status
        except (asyncio.TimeoutError, TimeoutError):
            raise RewardFailure(self.name, "timeout", f"no answer from {self.url}/score within "
                                f"prm.timeout={self.timeout} s") from None
        except aiohttp.ClientError as e:
            raise RewardFailure(self.name, "raised", f"request to {self.url}/score failed "
                                f"(prm.url): {type(e).__name__}: {e}") from e
        if status != 200:
            raise RewardFailure(self.name, "raised",
                                f"{self.url}/score answered HTTP {status}: {text[:300]}")
        try:
            scores = [float(s) for s in json.loads(text)["scores"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RewardFailure(self.name, "invalid", f"{self.url}/score answered {text[:300]!r}"
                                f" ({type(e).__name__}: {e})") from None
        if len(scores) != len(steps) or not all(math.isfinite(s) for s in scores):
            raise RewardFailure(self.name, "invalid", f"{self.url}/score gave {scores} for "
                                f"{len(steps)} steps (expected as many finite scores)")
        return scores
