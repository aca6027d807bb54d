"""The remote reward model client against the real `rm_server` process: scores round-trip in
batches; a 500, a hang past the timeout or a killed server make failed samples (never 0.0),
counted; past the error budget the run stops with an error naming the URL."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from areal_like.api.config import RewardConfig
from areal_like.rewards.checks import reward_name
from areal_like.rewards.failures import RewardBudgetExceeded, RewardFailure
from areal_like.rewards.remote_rm import RemoteRewardModel
from areal_like.rewards.reward_executor import RewardExecutor

PROMPT = "What is 12+30? Answer: "


class RMServer:
    """`python -m areal_like.rewards.rm_server --port 0 --test-controls [args]` (e.g.
    `--model DIR`), stopped on close."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_like.rewards.rm_server", "--port", "0",
             "--test-controls", *args], stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=60)
        if not line or not line[0].strip():
            self.close()
            raise RuntimeError("rm_server printed no address within 60 s")
        info = json.loads(line[0])
        self.url, self.base = info["url"], f"http://127.0.0.1:{info['port']}"

    def control(self, mode: str) -> None:
        req = urllib.request.Request(f"{self.base}/control", json.dumps({"mode": mode}).encode(),
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    def stats(self) -> dict:
        return json.loads(urllib.request.urlopen(f"{self.base}/stats", timeout=10).read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = RMServer()
    yield s
    s.close()


def _executor(**kw) -> RewardExecutor:
    return RewardExecutor(RewardConfig(**{"timeout": 5.0, "max_failure_rate": 0.5,
                                          "failure_window": 100, **kw}))


async def _score_all(ex, fn, completions, answer="42"):
    return await asyncio.gather(*(ex(fn, PROMPT, c, answer=answer) for c in completions),
                                return_exceptions=True)


async def test_scores_round_trip_in_batches(server):
    server.control("ok")
    rm = RemoteRewardModel(server.url, timeout=5.0, batch_size=4, batch_wait=0.05)
    assert reward_name(rm.score) == f"remote_rm({server.url})"
    before = len(server.stats()["batch_sizes"])
    ex = _executor()
    got = await _score_all(ex, rm.score, ["42", "41", " 42 ", "<answer>42</answer>", "x", "4 2"])
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert sorted(server.stats()["batch_sizes"][before:]) == [2, 4]
    assert ex.n_failed == 0
    # a copy sent to another process scores alike
    clone = pickle.loads(pickle.dumps(rm.score))
    assert await _executor()(clone, PROMPT, "42", answer="42") == 1.0
    await rm.aclose()
    await clone.__self__.aclose()


async def test_http_500_fails_the_sample_after_bounded_retries(server):
    rm = RemoteRewardModel(server.url, timeout=5.0, max_retries=2, retry_backoff=0.05)
    ex = _executor()
    server.control("error")
    try:
        before = server.stats()["requests"]
        got = await _score_all(ex, rm.score, ["42", "41"])
        after = server.stats()["requests"]
    finally:
        server.control("ok")
    for failure in got:
        assert isinstance(failure, RewardFailure) and failure.kind == "raised"
        assert "HTTP 500" in str(failure) and server.url in str(failure)
    assert after - before == 3  # one batch, 1 + max_retries attempts
    assert ex.n_failed == 2 and ex.failures["raised"] == 2
    await rm.aclose()


async def test_hang_past_the_timeout_is_a_timeout_not_retried(server):
    rm = RemoteRewardModel(server.url, timeout=0.5, max_retries=2, batch_wait=0.2)
    ex = _executor()
    server.control("hang")
    try:
        before = server.stats()["requests"]
        start = time.monotonic()
        (failure,) = await _score_all(ex, rm.score, ["42"])
        elapsed = time.monotonic() - start
        after = server.stats()["requests"]
    finally:
        server.control("ok")
    assert isinstance(failure, RewardFailure) and failure.kind == "timeout"
    assert "reward.timeout=0.5" in str(failure)
    # the 0.2 s batching window is not work: the request itself had its whole 0.5 s
    assert 0.7 <= elapsed < 30.0  # no retry (counted below); the bound only says: no hang
    assert after - before == 1
    assert ex.failures["timeout"] == 1
    await rm.aclose()


async def test_killed_server_fails_samples_then_the_budget_names_the_url():
    s = RMServer()
    rm = RemoteRewardModel(s.url, timeout=2.0, max_retries=1, retry_backoff=0.05)
    ex = _executor(max_failure_rate=0.2, failure_window=10)  # 2 failures allowed
    assert await ex(rm.score, PROMPT, "42", answer="42") == 1.0
    s.close()
    first = await _score_all(ex, rm.score, ["42"])
    assert isinstance(first[0], RewardFailure) and first[0].kind == "raised"
    assert "cannot reach" in str(first[0])
    with pytest.raises(RewardFailure):  # the second failure is still within the budget
        await ex(rm.score, PROMPT, "42", answer="42")
    with pytest.raises(RewardBudgetExceeded, match=f"remote_rm\\({s.url}\\)"):
        await ex(rm.score, PROMPT, "42", answer="42")
    assert ex.n_failed == 3
    await rm.aclose()


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="remote_rm_url"):
        RewardConfig(remote_rm_url="127.0.0.1:5000")
    with pytest.raises(ValueError, match="remote_rm_url"):
        RewardConfig(remote_rm_url="http://127.0.0.1:5000/get_reward", fn="pkg.mod:score")
    with pytest.raises(ValueError, match="remote_rm_batch_size"):
        RewardConfig(remote_rm_batch_size=0)
