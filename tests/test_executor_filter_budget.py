"""A should-accept filter that rejects everything stops the run, and no wait is silent.

Unit tests use the instant in-process engine from test_executor_fakes (a unit test of one
component: the executor); the last test is a real GRPO run (DAPO preset) through the local
launcher on the session's SGLang fleet with a reward that is always 0.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from config_helpers import rollout_config
from tensordict import TensorDict
from test_executor_fakes import GroupWorkflow, InstantEngine, eventually, group_ids, items

from areal_like.algorithms import ZeroVarianceGroupFilter, drop_zero_variance_groups
from areal_like.api import InferenceEngine
from areal_like.rollout import RolloutError, RolloutTimeoutError, wait_progress
from areal_like.rollout.filter_budget import FilterBudgetExceeded

# one episode at a time: they finish in submission order, so the streak is exact
CONFIG = dict(max_head_offpolicyness=100, consumer_batch_size=2, max_concurrent_rollouts=1)
ADVICE = ("set algorithm.filters.dynamic_sampling=false, or raise "
          "algorithm.filters.max_rejected_batches")


class SomeVary(GroupWorkflow):
    """GroupWorkflow (every sample of item i earns i % 2: zero variance), except that the
    items in `varied` get rewards 0, 1, ...: dynamic sampling accepts exactly those."""

    def __init__(self, varied: tuple[int, ...] = ()) -> None:
        super().__init__(n=2)
        self.varied = varied

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> Optional[TensorDict]:
        traj = await super().arun_episode(engine, data)
        if traj is not None and data["id"] in self.varied:
            traj["rewards"] = torch.arange(self.n, dtype=torch.float32)
        return traj


@pytest.fixture
def executor():
    engine = InstantEngine(rollout_config(**CONFIG))
    engine.initialize()
    yield engine.executor
    engine.destroy()


def judged(ex, n: int) -> None:
    """Wait until `n` episodes finished (accepted or rejected)."""
    eventually(lambda: ex.stats()["completed"] >= n, what=f"{n} episodes finished")
    assert ex.stats()["completed"] == n


def test_a_filter_rejecting_everything_stops_every_wait_after_exactly_its_budget(executor):
    ex, wf = executor, SomeVary()
    flt = ZeroVarianceGroupFilter(max_rejected_batches=2)  # 2 x consumer_batch_size 2 = 4
    for item in items(0, 3):
        ex.submit(item, wf, flt)
    judged(ex, 3)
    # one short of the budget: a wait still only times out, and says how far the streak is
    with pytest.raises(RolloutTimeoutError, match=r"dynamic_sampling rejected 3 group\(s\) in a "
                       r"row.*2 groups all 0\.0, 1 all 1\.0"):
        ex.wait(1, timeout=0.2)
    ex.submit(items(3, 4)[0], wf, flt)
    judged(ex, 4)
    for _ in range(2):  # every wait raises it, not only the first
        with pytest.raises(FilterBudgetExceeded) as caught:
            ex.wait(1, timeout=10)
        message = str(caught.value)
        assert message.startswith("algorithm.filters.dynamic_sampling rejected 4 group(s) in a "
                                  "row, none accepted in between (the run stops at "
                                  "max_rejected_batches 2 x consumer_batch_size 2 = 4): every "
                                  "group's rewards were equal: 2 groups all 0.0, 2 all 1.0. "
                                  "The run stops"), message
        assert ADVICE in message and isinstance(caught.value, RolloutError)
    with pytest.raises(FilterBudgetExceeded):  # and the next batch of a training loop
        ex.prepare_batch([items(10, 12)], wf, flt, timeout=10)
    assert ex.stats()["rejected_by_filter"] == 4 and ex.stats()["submitted"] == 4


def test_an_accepted_group_resets_the_count(executor):
    ex, wf = executor, SomeVary(varied=(3,))
    flt = ZeroVarianceGroupFilter(max_rejected_batches=2)
    for item in items(0, 7):  # rejected 0, 1, 2; accepted 3; rejected 4, 5, 6
        ex.submit(item, wf, flt)
    judged(ex, 7)
    assert group_ids(ex.wait(1, timeout=10)) == [3]  # 6 rejections, never 4 in a row
    with pytest.raises(RolloutTimeoutError, match=r"rejected 3 group\(s\) in a row"):
        ex.wait(1, timeout=0.2)
    ex.submit(items(8, 9)[0], wf, flt)
    judged(ex, 8)
    with pytest.raises(FilterBudgetExceeded, match=r"rejected 4 group\(s\) in a row.*: 3 groups "
                       r"all 0\.0, 1 all 1\.0\. "):
        ex.wait(1, timeout=10)


def test_a_plain_predicate_is_not_counted(executor):
    """drop_zero_variance_groups as a function (no budget): today's behaviour, a timeout."""
    with pytest.raises(RolloutTimeoutError, match="by should_accept") as caught:
        executor.prepare_batch([items(0, 2), items(2, 4)], SomeVary(),
                               drop_zero_variance_groups, timeout=1.0)
    assert "in a row" not in str(caught.value)
    assert executor.stats()["rejected_by_filter"] > 4  # past what a budget of 1 batch allows


def test_a_wait_logs_what_it_waits_for_every_interval(executor, caplog, monkeypatch):
    monkeypatch.setattr(wait_progress, "PROGRESS_INTERVAL_S", 0.05)
    caplog.set_level(logging.INFO, logger=wait_progress.__name__)
    ex, wf = executor, SomeVary(varied=(1, 5))
    flt = ZeroVarianceGroupFilter(max_rejected_batches=100)
    for item in items(1, 4):  # accepted 1; rejected 2 (all 0.0), 3 (all 1.0)
        ex.submit(item, wf, flt)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        batch = pool.submit(ex.wait, 2, 30)

        def told() -> bool:
            return any("accepted 1, rejected 2:" in r.getMessage()
                       and "rejected 2 group(s) in a row" in r.getMessage()
                       for r in caplog.records)

        eventually(told, what="a progress line with every episode judged")
        line = next(r.getMessage() for r in caplog.records if "accepted 1, rejected 2:" in
                    r.getMessage())
        assert line.startswith("wait(count=2) still waiting after "), line
        for part in ("1 of 2 groups ready", "2 by should_accept", "failed 0",
                     "excluded for a failed reward 0", "still running 0, queued 0",
                     "version 0, eta 100", "every group's rewards were equal: "
                     "1 group all 0.0, 1 all 1.0"):
            assert part in line, (part, line)
        ex.submit(items(5, 6)[0], wf, flt)  # the second group the wait needs
        assert group_ids(batch.result(timeout=30)) == [1, 5]


def test_a_short_wait_logs_nothing(executor, caplog):
    caplog.set_level(logging.INFO, logger=wait_progress.__name__)
    assert wait_progress.PROGRESS_INTERVAL_S < 60  # no wait is silent for a minute
    executor.submit(items(1, 2)[0], SomeVary(varied=(1,)), ZeroVarianceGroupFilter())
    assert group_ids(executor.wait(1, timeout=10)) == [1]
    assert not [r for r in caplog.records if r.name == wait_progress.__name__]


@pytest.mark.sglang
@pytest.mark.e2e
def test_dapo_on_a_model_that_never_earns_a_reward_stops_the_run(fresh_fleet, tiny_model_dir,
                                                                 tmp_path):
    """GRPO with the DAPO preset through the launcher, every reward 0 (reward_fns.always_zero):
    dynamic sampling rejects every group, and after max_rejected_batches=1 x
    consumer_batch_size=2 rejections the run exits non-zero saying why, instead of waiting
    for an hour."""
    from bad_run_helpers import run_until_exit
    from sglang_helpers import attach_args

    tests = str(Path(__file__).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "areal_like.launcher.local", "grpo",
           f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
           "algorithm.preset=dapo", "algorithm.filters.max_rejected_batches=1",
           "reward.fn=reward_fns:always_zero", "total_train_steps=20", "gconfig.n_samples=2",
           "gconfig.max_new_tokens=4", "rollout.staleness.consumer_batch_size=2",
           "train_dataset.batch_size=2", "train_dataset.size=64", "valid_dataset.size=4",
           "evaluation.n_prompts=4", "evaluation.freq_steps=100", "logging.tensorboard=false",
           "logging.plot=false", *attach_args(fresh_fleet)]
    start = time.monotonic()
    code, lines = run_until_exit(cmd, env, "algorithm.filters.dynamic_sampling rejected")
    out = "".join(lines)
    assert code != 0, out[-4000:]
    assert ("algorithm.filters.dynamic_sampling rejected 2 group(s) in a row" in out
            and "every group's rewards were equal: 2 groups all 0.0" in out
            and "too hard for the model" in out and ADVICE in out), out[-4000:]
    last = [line for line in lines if line.strip()][-1]
    assert "trainer exited with code" in last, last
    print(f"the run stopped {time.monotonic() - start:.0f} s after its start")
