"""A workflow's rewards reach it explicitly: the executor it was built with, else the one the
executor running its episode hands that episode (no process-global executor), so a workflow
sent to another process carries no executor and unpickling order cannot matter. Unit tests
with the instant in-process engine; the controller process and real servers run the same
path in test_rollout_process.py and every recipe test."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, Optional

import pytest
from config_helpers import rollout_config
from tensordict import TensorDict
from test_executor_fakes import GroupWorkflow, InstantEngine, items

from areal_like.api import InferenceEngine
from areal_like.api.config import RewardConfig
from areal_like.rewards.reward_executor import RewardExecutor, UsesRewards
from areal_like.rollout import WorkflowExecutor

CONFIG = rollout_config(max_concurrent_rollouts=8, max_head_offpolicyness=10**6,
                       consumer_batch_size=1)


async def prompt_length(prompt: str, completion: str, **data: Any) -> float:
    return float(len(prompt))


class ScoredWorkflow(GroupWorkflow, UsesRewards):
    """GroupWorkflow whose rewards come from its reward executor."""

    def __init__(self, reward_executor: Optional[RewardExecutor] = None) -> None:
        super().__init__(n=2)
        self.use_rewards(prompt_length, reward_executor)

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> Optional[TensorDict]:
        trajectory = await super().arun_episode(engine, data)
        prompt = "x" * len(data["prompt"])
        rewards = await asyncio.gather(*[self.reward_executor(prompt_length, prompt, "")
                                         for _ in range(self.n)])
        trajectory["rewards"][:] = trajectory["rewards"].new_tensor(rewards)
        return trajectory


@pytest.fixture
def rewards():
    made = [RewardExecutor(RewardConfig(use_processes=False)) for _ in range(3)]
    yield made
    for executor in made:
        executor.shutdown()


def _executor(rewards: Optional[RewardExecutor]) -> WorkflowExecutor:
    executor = WorkflowExecutor(CONFIG, InstantEngine(CONFIG), wait_timeout=30.0,
                                rewards=rewards)
    executor.initialize()
    return executor


def test_each_episode_scores_with_the_executor_that_runs_it(rewards):
    first, second, own = rewards
    a, b = _executor(first), _executor(second)
    try:
        workflow = ScoredWorkflow()
        batch = a.rollout_batch(items(0, 3), workflow)
        assert batch["rewards"].tolist() == [float(len(it["prompt"])) for it in items(0, 3)
                                             for _ in range(2)]
        # the same workflow, sent to another process as it would be: no executor in it
        copied = pickle.loads(pickle.dumps(workflow))
        assert copied._reward_executor is None
        b.rollout_batch(items(3, 5), copied)
        assert (first.n_calls, second.n_calls) == (6, 4)

        # a workflow built with its own executor keeps it, wherever it runs
        a.rollout_batch(items(5, 6), ScoredWorkflow(own))
        assert (first.n_calls, own.n_calls) == (6, 2)
    finally:
        a.destroy()
        b.destroy()


def test_an_episode_nobody_gave_an_executor_says_so(rewards):
    workflow = ScoredWorkflow()
    engine = InstantEngine(CONFIG)
    with pytest.raises(RuntimeError, match="no reward executor for this episode"):
        asyncio.run(workflow.arun_episode(engine, items(0, 1)[0]))
    executor = _executor(None)  # an executor without one: its episodes fail the same way
    try:
        with pytest.raises(RuntimeError, match="no reward executor for this episode"):
            executor.rollout_batch(items(0, 1), workflow)
    finally:
        executor.destroy()


def test_an_executor_sent_to_another_process_arrives_as_a_new_one_with_its_settings():
    config = RewardConfig(use_processes=False, timeout=7.0, max_failure_rate=0.25)
    executor = RewardExecutor(config)
    try:
        asyncio.run(executor(prompt_length, "ab", ""))
        copy = pickle.loads(pickle.dumps(executor))
        assert copy is not executor and copy.config == config
        assert (executor.n_calls, copy.n_calls) == (1, 0)  # counts and budgets stay behind
    finally:
        executor.shutdown()
