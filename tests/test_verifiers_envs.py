"""`verifiers` (v1) environments run unchanged as workflows (workflows/verifiers_env.py): the
real verifiers 0.4 package in its own venv plays each environment's own loop (its chat
harness, its tool server, its turns) against the agent gateway; its own rubric's reward
becomes the trajectories' reward.

Against the session's real SGLang fleet: both example environments' episodes are trajectories
(per-token versions and log-probabilities), rewarded with what the rubric computes for the
recorded completion text (computed here, independently), and the multi-turn environment
continues its conversation. The tiny model never writes a valid tool call, so the tool path
runs against a gateway over a scripted model: it calls `calculate`, the environment's tool
server computes it and sends the result back, the model answers, the rubric gives 1.0.
Failures (a bad env spec, a rubric that raises) fail the episode naming the spec."""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_controller
from test_openai_client import ScriptedEngine
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from areal_like.utils import stats_tracker
from workflows.program import ProgramError
from workflows.verifiers_env import (
    VerifiersVenvMissing,
    VerifiersWorkflow,
    load_verifiers_items,
    resolve_verifiers_python,
)

# only the fleet test is in the serial lane (its `sglang_fleet` marks it); the scripted and
# failure tests run beside it in the in-process lane
ADDITION = "examples/verifiers_envs/addition_single_turn.py:load_environment"
CALCULATOR = "examples/verifiers_envs/calculator_tools.py:load_environment"
NUDGE = "Please give the final answer as a number in \\boxed{}."  # calculator_tools.NUDGE
WAIT_S = 300  # a bound for a hang, not the expected time
BROKEN_RUBRIC_ENV = '''
import verifiers.v1 as vf

class Data(vf.TaskData):
    pass

class BrokenTask(vf.Task[Data]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("the rubric broke")

class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        return [BrokenTask(Data(prompt="1 + 1 ="), self.config.task)]

__all__ = ["BrokenTaskset"]

def load_environment():
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id=__name__),
        agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig())))
'''


def boxed_reward(text: str, answer: int) -> float:
    """The examples' rubric, written independently: the last \\boxed{...} equals the answer."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", text.strip())
    return float(bool(found) and found[-1].strip() == str(answer))


@pytest.fixture(scope="module")
def verifiers_venv() -> Path:
    try:
        return resolve_verifiers_python()
    except VerifiersVenvMissing as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the verifiers tests: {e}")
        pytest.skip(f"verifiers venv missing: {e}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def items(verifiers_venv) -> dict[str, list[dict]]:
    """Each environment's own tasks (its eval split), through the runner's `items` mode."""
    with ThreadPoolExecutor(2) as pool:
        loaded = dict(zip((ADDITION, CALCULATOR), pool.map(
            lambda spec: load_verifiers_items(spec, n=2, split="eval"), (ADDITION, CALCULATOR)),
            strict=True))
    for item in loaded[ADDITION]:
        assert item["prompt"] == f"What is {item['a']} + {item['b']}?"
        assert item["answer"] == item["a"] + item["b"]
    for item in loaded[CALCULATOR]:
        a, op, b, c = re.fullmatch(r"(\d+) (\*) (\d+) ([+-] \d+)", item["expression"]).groups()
        assert item["answer"] == int(a) * int(b) + int(c.replace(" ", ""))
    assert all(len(v) == 2 for v in loaded.values())
    return loaded


def _completions(batch, tokenizer) -> list[str]:
    """Each row's generated text ("individual" export: one row per model call)."""
    return [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(batch["input_ids"], batch["loss_mask"], strict=True)]


def test_both_environments_are_episodes_on_the_fleet(sglang_fleet, tokenizer, items):
    controller = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    gconfig = GenerationHyperparameters(max_new_tokens=8)
    workflows = [VerifiersWorkflow(spec, gconfig, tokenizer, timeout_s=WAIT_S,
                                   export_style="individual") for spec in (ADDITION, CALCULATOR)]
    add_item, calc_item = items[ADDITION][0], items[CALCULATOR][0]

    async def episodes():
        try:
            return await asyncio.gather(workflows[0].arun_episode(controller, add_item),
                                        workflows[1].arun_episode(controller, calc_item))
        finally:
            for workflow in workflows:
                await workflow.aclose()

    try:
        single, multi = controller.run_coroutine(episodes(), timeout=WAIT_S)
        version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    finally:
        controller.destroy()
    for batch, item in ((single, add_item), (multi, calc_item)):
        texts = _completions(batch, tokenizer)
        # the rubric's reward on every call of the episode: computed here from the last reply
        expected = boxed_reward(texts[-1], item["answer"])
        assert batch["rewards"].tolist() == [expected] * len(texts)
        trained = batch["loss_mask"].bool()
        assert set(batch["versions"][trained].tolist()) == {version}
        assert torch.isfinite(batch["logprobs"][trained]).all()
        assert (batch["logprobs"][trained] <= 0).all()
        assert batch["group_id"].unique().numel() == 1
    assert single["input_ids"].shape[0] == 1  # single-turn: one model call
    # the tiny model never boxes an answer: the environment's loop nudged it, a second call
    # whose prompt holds the first reply and the nudge
    assert multi["input_ids"].shape[0] == 2
    prompt_part = multi["attention_mask"][1].bool() & ~multi["loss_mask"][1].bool()
    second_prompt = tokenizer.decode(multi["input_ids"][1][prompt_part])
    assert calc_item["prompt"] in second_prompt and NUDGE in second_prompt


def test_the_tool_path_with_a_scripted_model(tokenizer, items):
    """The model calls `calculate`; the environment's tool server runs it and sends back the
    result; the model answers; the rubric gives 1.0. The single-turn environment too."""
    calc_item, add_item = items[CALCULATOR][1], items[ADDITION][1]
    call = "<tool_call>" + json.dumps({"name": "calculate", "arguments": {
        "expression": calc_item["expression"]}}) + "</tool_call>"
    tool_model = ScriptedEngine(tokenizer, [f"Let me compute. {call}",
                                            f"The answer is \\boxed{{{calc_item['answer']}}}."])
    add_model = ScriptedEngine(tokenizer, [f"\\boxed{{{add_item['answer']}}}"])
    gconfig = GenerationHyperparameters(max_new_tokens=64)
    workflows = [VerifiersWorkflow(spec, gconfig, tokenizer, timeout_s=WAIT_S,
                                   export_style="individual") for spec in (CALCULATOR, ADDITION)]

    async def episodes():
        try:
            return await asyncio.gather(workflows[0].arun_episode(tool_model, calc_item),
                                        workflows[1].arun_episode(add_model, add_item))
        finally:
            for workflow in workflows:
                await workflow.aclose()

    stats_tracker.export()  # what earlier tests recorded
    tools, single = asyncio.run(asyncio.wait_for(episodes(), WAIT_S))
    # the environments' own metrics: the calculator's tool count, each episode's turns
    stats = stats_tracker.export()
    assert stats["verifiers/tool_calls"] == 1.0 and stats["verifiers/turns"] == 1.5
    assert tools["rewards"].tolist() == [1.0, 1.0] and single["rewards"].tolist() == [1.0]
    assert tool_model.texts == [] and add_model.texts == []  # every scripted reply was asked for
    # the tool's result (computed by the environment, not scripted) follows the call in the
    # second prompt, which extends the first call's exact ids
    first, second = tool_model.prompts
    after_call = tokenizer.decode(second).split("</tool_call>", 1)[1]
    assert str(calc_item["answer"]) in after_call and calc_item["prompt"] not in after_call
    assert second[:len(first)] == first
    assert set(tools["versions"][tools["loss_mask"].bool()].tolist()) == {3}  # the script's


def test_a_bad_spec_and_a_broken_rubric_fail_the_episode_naming_the_spec(tokenizer, tmp_path,
                                                                         verifiers_venv):
    broken = tmp_path / "broken_rubric_env.py"
    broken.write_text(BROKEN_RUBRIC_ENV)
    specs = [f"{tmp_path}/no_such_env.py:load_environment", f"{broken}:load_environment"]
    gconfig = GenerationHyperparameters(max_new_tokens=8)
    workflows = [VerifiersWorkflow(spec, gconfig, tokenizer, timeout_s=WAIT_S) for spec in specs]
    engine = ScriptedEngine(tokenizer, ["2"])

    async def episodes():
        try:
            return await asyncio.gather(*(w.arun_episode(engine, {"prompt": "1 + 1 ="})
                                          for w in workflows), return_exceptions=True)
        finally:
            for workflow in workflows:
                await workflow.aclose()

    missing, raised = asyncio.run(asyncio.wait_for(episodes(), WAIT_S))
    assert isinstance(missing, ProgramError), missing
    assert "exited with code 2" in str(missing)
    assert f"env spec '{specs[0]}': no file" in str(missing)
    assert isinstance(raised, ProgramError), raised  # never a reward of 0
    assert "exited with code 3" in str(raised) and f"env spec '{specs[1]}'" in str(raised)
    assert "the rubric broke" in str(raised)
    assert engine.texts == []  # the broken rubric's episode did run its model call
    with pytest.raises(ValueError, match="env spec 'no-colon': expected"):
        VerifiersWorkflow("no-colon", gconfig, tokenizer)
    with pytest.raises(VerifiersVenvMissing, match="install_verifiers.sh /nowhere/venv"):
        VerifiersWorkflow(ADDITION, gconfig, tokenizer, venv="/nowhere/venv")


def test_the_result_is_the_runners_last_stdout_line():
    from workflows.verifiers_env import parse_result

    assert parse_result('log line\n{"reward": 0.5, "metrics": {}, "turns": 1}\n\n') == {
        "reward": 0.5, "metrics": {}, "turns": 1}
    for stdout in ("", "done\n", '{"reward": 1.0}\ntrailing text\n', '{"metrics": {}}'):
        with pytest.raises(ProgramError, match="last stdout line is not its result"):
            parse_result(stdout)
