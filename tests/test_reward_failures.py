"""Failed rewards against real SGLang servers and real reward worker processes: a failed
sample never reaches training as a reward, its group is excluded (or only itself, when the
estimator allows), every exclusion is counted, evaluation excludes rather than scores 0."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import reward_fns
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from areal_like.rewards.failures import RewardBudgetExceeded, RewardFunctionError
from areal_like.rollout.controller import RolloutController
from areal_like.rollout.evaluation import evaluate
from workflows import RLVRWorkflow

pytestmark = pytest.mark.sglang
GCONFIG = GenerationHyperparameters(n_samples=4, max_new_tokens=5, temperature=1.0)


def _items(n: int, **extra) -> list[dict]:
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": f"What is {i} + 1?"}],
             "answer": str(i + 1), **extra} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(sglang_fleet) -> Iterator[RolloutController]:
    engine = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY, seed=5,
                         max_concurrent_rollouts=16)
    yield engine
    engine.destroy()


def _completion(tokenizer, batch, row: int) -> str:
    ids = batch["input_ids"][row][batch["loss_mask"][row].bool()].tolist()
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("keep_partial", [False, True])
def test_raising_reward_never_becomes_a_reward(engine, tokenizer, executor_factory,
                                               keep_partial):
    """The reward raises for a third of the completions. Without group statistics allowed
    to break, groups with a failure are excluded whole; otherwise only the failed samples.
    Every trained row's reward is the function's own value for its completion."""
    executor = executor_factory(max_failure_rate=1.0)
    engine.executor.keep_partial_groups = keep_partial
    workflow = RLVRWorkflow(reward_fns.raises_on_third, GCONFIG, tokenizer, executor)
    items = _items(8)
    batch = engine.rollout_batch(items, workflow)
    stats = engine.executor.stats()
    failed_calls = executor.failures["raised"]
    assert failed_calls >= 1 and executor.n_calls == 8 * GCONFIG.n_samples
    for row in range(batch.batch_size[0]):
        text = _completion(tokenizer, batch, row)
        assert len(text) % 3 != 0  # no failed sample was trained on
        assert float(batch["rewards"][row]) == reward_fns.raises_on_third("", text)
    groups = batch["group_id"].unique().numel()
    if keep_partial:
        assert batch.batch_size[0] == 8 * GCONFIG.n_samples - failed_calls
        assert stats["failed_reward"] + groups == 8  # groups left with no sample are excluded
    else:
        assert batch.batch_size[0] == groups * GCONFIG.n_samples
        assert groups + stats["failed_reward"] == 8 and stats["failed_reward"] >= 1


def test_hanging_reward_costs_only_its_group_on_a_busy_machine(engine, tokenizer,
                                                               executor_factory,
                                                               busy_machine, caplog):
    executor = executor_factory(timeout=5.0, max_workers=2)
    workflow = RLVRWorkflow(reward_fns.hangs_on, GCONFIG, tokenizer, executor)
    items = _items(16)
    items[5]["hang"] = True
    with caplog.at_level(logging.WARNING):
        batch = engine.rollout_batch(items, workflow, timeout=600)
    assert batch.batch_size[0] == 15 * GCONFIG.n_samples
    assert executor.failures == {"timeout": GCONFIG.n_samples}
    assert engine.executor.stats()["failed_reward"] == 1
    assert "15 of 16 items gave a trajectory to train on (excluded for a failed reward 1)" in caplog.text
    for row in range(batch.batch_size[0]):  # the others kept their real rewards
        item = items[row // GCONFIG.n_samples + (row >= 5 * GCONFIG.n_samples)]
        text = _completion(tokenizer, batch, row)
        assert float(batch["rewards"][row]) == float(text.strip() == item["answer"])


def test_a_reward_that_always_fails_stops_the_run(engine, tokenizer, executor_factory):
    executor = executor_factory(max_failure_rate=0.05, failure_window=100)
    workflow = RLVRWorkflow(reward_fns.raises, GCONFIG, tokenizer, executor)
    with pytest.raises(RewardBudgetExceeded) as info:
        engine.rollout_batch(_items(4), workflow)
    message = str(info.value)
    assert "reward function raises failed 6 of its last 6 calls" in message
    assert "First failure: reward function raises raised: ValueError: verifier exploded" \
        in message and 'reward_fns.py", line' in message


def test_lambda_reward_is_refused_when_the_workflow_is_built(tokenizer, executor_factory):
    with pytest.raises(RewardFunctionError, match="<lambda>.*cannot be sent to reward worker"):
        RLVRWorkflow(lambda p, c, **_: 1.0, GCONFIG, tokenizer, executor_factory())


def test_evaluation_excludes_failed_rewards(engine, tokenizer, executor_factory):
    executor = executor_factory(max_failure_rate=1.0)
    items = _items(12)
    result = evaluate(engine, items, reward_fns.raises_on_third, tokenizer, GCONFIG,
                      reward_executor=executor)
    failed = executor.failures["raised"]
    assert result["eval/reward_failed"] == failed >= 1
    assert result["eval/n"] == 12 - failed
