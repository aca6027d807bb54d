"""The rollout controller as a process of its own (`RolloutProcess`) and evaluation pinned to
a version (`RolloutController.run_at_version`), against the session's real SGLang fleet."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest
from config_helpers import rollout_config
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from areal_like.api.config import RewardConfig
from areal_like.api.io_struct import UpdateReport
from areal_like.rewards import exact_match_reward
from areal_like.rollout.evaluation import Evaluator
from areal_like.rollout.process import RolloutProcess, RolloutProcessError
from areal_like.rollout.service import RolloutSetup
from workflows import RLVRWorkflow

pytestmark = pytest.mark.sglang
GCONFIG = GenerationHyperparameters(n_samples=2, max_new_tokens=4, temperature=1.0)
ITEMS = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
          "answer": str(2 * i)} for i in range(8)]


def _process(fleet, tokenizer, eval_timeout: float = 600.0, **rollout) -> RolloutProcess:
    config = rollout_config(server_addrs=list(fleet.addresses), api_key=SGLANG_TEST_API_KEY,
                           seed=3, **rollout)
    evaluator = Evaluator(ITEMS[:4], exact_match_reward, tokenizer, GCONFIG)
    process = RolloutProcess(RolloutSetup(rollout=config, reward=RewardConfig(max_workers=1),
                                          evaluator=evaluator, eval_timeout=eval_timeout))
    process.initialize()
    process.set_version(fleet_version(fleet.addresses, SGLANG_TEST_API_KEY))
    return process


def test_batches_evaluations_and_errors_cross_the_process(sglang_fleet, tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # eta = 1: two batches at one version (and evaluation does not block, as at eta > 0)
    process = _process(sglang_fleet, tokenizer, consumer_batch_size=2, max_head_offpolicyness=1)
    try:
        assert process.pid is not None and process.pid != os.getpid()
        workflow = RLVRWorkflow(exact_match_reward, GCONFIG, tokenizer)
        loader = [ITEMS[i:i + 2] for i in range(0, len(ITEMS), 2)]
        batch = process.prepare_batch(loader, workflow, timeout=300)
        assert batch.batch_size[0] == 4  # 2 groups x 2 samples
        assert batch["input_ids"].is_shared()  # through shared memory, not the pipe
        assert len(process.last_episode_ids) == 2
        second = process.prepare_batch(loader, workflow, timeout=300)  # objects sent once
        assert set(second["group_id"].tolist()).isdisjoint(batch["group_id"].tolist())

        # an evaluation started at version v is served by v: the update waits for it
        version = process.get_version()
        process.start_evaluation(version)
        process.update_weights(WeightUpdateMeta.from_disk(str(tiny_model_dir), version + 1))
        assert process.get_version() == version + 1
        [(evaluated, metrics)] = process.finished_evaluations(wait=True)
        assert evaluated == version and metrics["eval/n"] == 4.0
        assert process.finished_evaluations(wait=True) == []

        # a driven update: its end is one-way, and the next call sees its effect
        view = process.begin_weight_update(version + 2, "retract")
        assert set(view.in_service) == set(sglang_fleet.addresses)
        meta = WeightUpdateMeta.from_disk(str(tiny_model_dir), version + 2)
        process.end_weight_update(UpdateReport(meta, loaded=list(view.in_service), advanced=True))
        assert process.get_version() == version + 2
        # a one-way call's error is raised by the next call, which does not run
        process.end_weight_update(None)  # type: ignore[arg-type]
        with pytest.raises(AttributeError, match="meta") as failed:
            process.set_version(version + 1)
        assert "raised by end_weight_update" in "".join(failed.value.__notes__)
        assert process.get_version() == version + 2  # set_version did not run
        process.set_version(version + 1)

        # an error inside the controller comes back as its own type, with its traceback
        with pytest.raises(ValueError, match="count must be >= 1") as info:
            process.wait(0, timeout=5)
        assert "in the rollout controller process" in "".join(info.value.__notes__)
        # what cannot be sent is named before anything is sent
        with pytest.raises(TypeError, match="must be picklable"):
            process.submit(ITEMS[0], workflow, should_accept=lambda td: True)
        assert process.get_version() == version + 1  # still usable
    finally:
        process.destroy()


def test_at_eta0_an_evaluation_past_its_timeout_is_an_error(sglang_fleet, tiny_model_dir: Path):
    """At eta = 0 training waits for evaluation (nothing it trains on shares the servers with
    it); one that does not finish within the evaluation timeout is an error naming the
    version, not an evaluation left running beside training."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    process = _process(sglang_fleet, tokenizer, eval_timeout=2.0, max_head_offpolicyness=0)
    try:
        version = process.get_version()
        process.pause()  # the fleet holds every request: the evaluation cannot finish
        try:
            with pytest.raises(TimeoutError, match=f"evaluation of version {version} did "
                                                   "not finish within 2 s"):
                process.start_evaluation(version)
        finally:
            process.resume()
        assert process.finished_evaluations(wait=True) == []  # not left to fail later
        process.start_evaluation(version)  # the fleet serves again: so does evaluation
        [(evaluated, metrics)] = process.finished_evaluations(wait=True)
        assert evaluated == version and metrics["eval/n"] == 4.0
    finally:
        process.destroy()


def test_a_dead_controller_fails_the_call_in_flight(sglang_fleet, tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # its placement is checked here, where it does no work: a controller niced and pinned to
    # one core that a busy machine shares can take minutes over a batch
    core = max(os.sched_getaffinity(0))
    process = _process(sglang_fleet, tokenizer, controller_nice=2, controller_cpus=[core])
    errors: list[BaseException] = []

    def blocked_wait() -> None:  # nothing submitted: blocks until the controller dies
        try:
            process.wait(1, timeout=300)
        except BaseException as e:  # noqa: BLE001  (checked below)
            errors.append(e)

    caller = threading.Thread(target=blocked_wait)
    try:
        assert process.pid is not None
        # controller_nice: it yields the cores to the trainer (niceness relative to ours)
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + 2)
        assert os.sched_getaffinity(process.pid) == {core}  # controller_cpus
        caller.start()
        os.kill(process.pid, signal.SIGKILL)
        caller.join(60)
        assert not caller.is_alive()
        assert isinstance(errors[0], RolloutProcessError)
        assert "killed by signal 9" in str(errors[0])
        with pytest.raises(RolloutProcessError, match="died"):
            process.get_version()
    finally:
        process.destroy()


def test_work_at_a_version_holds_the_next_update(sglang_fleet, tiny_model_dir: Path):
    """Requests started with `run_at_version` finish on the weights they started with; the
    update waits for them instead of retracting them."""
    controller = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    try:
        version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
        controller.set_version(version)
        g = GenerationHyperparameters(max_new_tokens=48, min_new_tokens=48, temperature=1.0)

        async def long_requests() -> list[list[int]]:
            responses = await asyncio.gather(*[
                controller.engine.agenerate(ModelRequest(input_ids=[5, i + 1], gconfig=g))
                for i in range(4)])
            return [r.output_versions for r in responses]

        held = controller.run_at_version(long_requests())
        controller.update_weights(WeightUpdateMeta.from_disk(str(tiny_model_dir), version + 1))
        assert held.done()
        versions = held.result()
        assert all(v == [version] * 48 for v in versions)
        assert controller.get_version() == version + 1
    finally:
        controller.destroy()
