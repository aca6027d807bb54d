"""Reward execution in a real process pool: results, errors and timeouts are bounded."""

from __future__ import annotations

import asyncio

import pytest
import reward_fns

from areal_like.rewards.executor import RewardError, RewardExecutor


async def test_sync_rewards_run_in_processes_and_async_rewards_directly():
    executor = RewardExecutor(max_workers=1, timeout=60)

    async def async_reward(prompt, completion, **_):
        await asyncio.sleep(0)
        return len(completion)

    try:
        values = await asyncio.gather(
            executor(reward_fns.right_if_42, "q", " 42 "),
            executor(reward_fns.right_if_42, "q", "41"),
            executor(reward_fns.right_if_42, "q", "7", answer="7", extra="ignored"),
            executor(async_reward, "q", "abc"),
        )
    finally:
        executor.shutdown()
    assert values == [1.0, 0.0, 1.0, 3.0]
    assert (executor.n_calls, executor.n_errors, executor.n_timeouts) == (4, 0, 0)


async def test_raising_reward_gives_zero_and_is_counted(caplog):
    executor = RewardExecutor(timeout=60)
    try:
        assert await executor(reward_fns.raises, "q", "boom") == 0.0
    finally:
        executor.shutdown()
    assert executor.n_errors == 1
    assert "verifier exploded on boom" in caplog.text


async def test_timeout_gives_zero_kills_the_worker_and_recovers():
    executor = RewardExecutor(timeout=3.0)
    try:
        assert await executor(reward_fns.sleeps, "q", "x") == 0.0
        assert executor.n_timeouts == 1
        # the pool was rebuilt: the next call works
        assert await executor(reward_fns.right_if_42, "q", "42") == 1.0
    finally:
        executor.shutdown()


async def test_on_error_raise_names_the_reward():
    executor = RewardExecutor(on_error="raise", use_processes=False)
    with pytest.raises(RewardError, match="raises raised ValueError"):
        await executor(reward_fns.raises, "q", "x")
    with pytest.raises(ValueError, match="on_error"):
        RewardExecutor(on_error="ignore")
