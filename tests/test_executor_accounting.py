"""Every submitted episode is accounted for: returned, rejected, or failed with its cause
counted; a failed reward excludes its group (or only its samples, when allowed); a cancelled
episode is a failure, not a disappearance. Unit tests of the executor with the instant
in-process engine (the same paths against a real server: tests/test_reward_failures.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import pytest
from config_helpers import rollout_config
from tensordict import TensorDict
from test_executor_fakes import GroupWorkflow, InstantEngine, items

from areal_like.rewards.failures import GroupRewardFailure, RewardBudgetExceeded, RewardFailure
from areal_like.rollout import NoTrajectoriesError, RolloutWorkflowError


@pytest.fixture
def engine():
    engine = InstantEngine(rollout_config(max_head_offpolicyness=0, consumer_batch_size=4))
    engine.initialize()
    yield engine
    engine.destroy()


class FailingRewards(GroupWorkflow):
    """Items in `fail_reward_ids` lose the reward of their first sample."""

    def __init__(self, fail_reward_ids: tuple[int, ...] = (), budget_at: int = -1, **kw):
        super().__init__(n=3, **kw)
        self.fail_reward_ids = fail_reward_ids
        self.budget_at = budget_at

    async def arun_episode(self, engine, data: dict) -> Optional[TensorDict]:
        group = await super().arun_episode(engine, data)
        if data["id"] == self.budget_at:
            raise RewardBudgetExceeded("reward function r failed 11 of its last 200 calls")
        if data["id"] in self.fail_reward_ids:
            failure = RewardFailure("r", "timeout", "no result 15 s after it started")
            raise GroupRewardFailure([failure], survivors=group[1:])
        return group


def _data_ids(batch: TensorDict) -> list[int]:
    return batch["data_id"].tolist()


def test_failed_rewards_exclude_their_groups_and_say_so(engine, caplog):
    executor = engine.executor
    with caplog.at_level(logging.WARNING):
        batch = executor.rollout_batch(items(0, 6), FailingRewards(fail_reward_ids=(1, 4)))
    assert _data_ids(batch) == [0] * 3 + [2] * 3 + [3] * 3 + [5] * 3
    assert executor.stats()["failed_reward"] == 2
    assert "rollout_batch: 4 of 6 items gave a trajectory to train on (excluded for a failed reward 2)" \
        in caplog.text


def test_partial_groups_are_kept_only_when_allowed(engine):
    executor = engine.executor
    executor.keep_partial_groups = True
    batch = executor.rollout_batch(items(0, 3), FailingRewards(fail_reward_ids=(1,)))
    assert _data_ids(batch) == [0] * 3 + [1] * 2 + [2] * 3  # item 1 without its failed sample
    stats = executor.stats()
    assert (stats["partial_groups"], stats["failed_reward"], stats["accepted"]) == (1, 0, 3)


def test_prepare_batch_replaces_excluded_groups(engine):
    batch = engine.executor.prepare_batch([items(0, 4), items(4, 8), items(8, 12)],
                                          FailingRewards(fail_reward_ids=(0, 2, 5)))
    groups = sorted(set(_data_ids(batch)))
    assert len(groups) == 4 and not {0, 2, 5} & set(groups)
    assert engine.executor.stats()["failed_reward"] >= 2


def test_all_groups_failing_is_an_error_with_the_reason(engine):
    with pytest.raises(NoTrajectoriesError, match=r"0 of 2 items .*excluded for a failed reward 2"):
        engine.executor.rollout_batch(items(0, 2), FailingRewards(fail_reward_ids=(0, 1)))


def test_spent_reward_budget_stops_the_caller(engine):
    with pytest.raises(RewardBudgetExceeded, match="failed 11 of its last 200 calls"):
        engine.executor.rollout_batch(items(0, 3), FailingRewards(budget_at=1))


class CancelledInside(GroupWorkflow):
    """Awaits a future that something else cancels (as a pool shutdown once did)."""

    async def arun_episode(self, engine, data: dict) -> Optional[TensorDict]:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.cancel)
        await future
        return None


def test_an_episode_cancelled_from_inside_is_a_failure_not_a_disappearance(engine):
    with pytest.raises(RolloutWorkflowError, match="was cancelled while the executor was "
                                                   "running") as info:
        engine.executor.rollout_batch(items(0, 2), CancelledInside())
    assert info.value.data_id == "0"
    stats = engine.executor.stats()
    assert stats["cancelled"] == 0 and stats["failed"] == 2
