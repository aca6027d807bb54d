"""The OpenAI-compatible client: agent code for `openai.AsyncOpenAI` runs on our engine, each
call recorded token-in/token-out; rewards per completion or per trajectory; recorded calls
become a training batch. Server behaviour against real SGLang; the client's parsing and its
errors against a scripted engine (a unit test of this one component)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters, ModelResponse
from workflows import ArealOpenAI

CHATML_TURN = "<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def _two_turns(client: ArealOpenAI):
    messages = [{"role": "user", "content": "12 + 30 ="}]
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=8, temperature=1.0)
    messages += [first.choices[0].message, {"role": "user", "content": "Again?"}]
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  max_tokens=8)
    return first, second


@pytest.mark.sglang
def test_a_second_turn_keeps_the_first_turns_tokens_and_exports_both(sglang_fleet, tokenizer):
    controller = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    try:
        version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
        client = ArealOpenAI(controller, tokenizer, GenerationHyperparameters(max_new_tokens=8))
        first, second = controller.run_coroutine(_two_turns(client), timeout=300)
    finally:
        controller.destroy()
    one, two = client.completions
    assert [one.id, two.id] == [first.id, second.id] and two.parent is one
    # the reference prompt, from the ChatML text written out here (not the client's code)
    expected_first = tokenizer.encode(
        CHATML_TURN.format(role="user", content="12 + 30 =") + "<|im_start|>assistant\n",
        add_special_tokens=False)
    assert one.prompt_ids == expected_first
    assert first.choices[0].message.content == tokenizer.decode(
        one.completion_ids, skip_special_tokens=True)
    # token-in/token-out: turn 2's prompt is turn 1's exact ids, then only the new text
    closed = one.completion_ids[-1:] == [tokenizer.eos_token_id]
    head = expected_first + one.completion_ids + ([] if closed else [tokenizer.eos_token_id])
    tail = tokenizer.encode("\n" + CHATML_TURN.format(role="user", content="Again?")
                            + "<|im_start|>assistant\n", add_special_tokens=False)
    assert two.prompt_ids == head + tail
    assert second.usage.prompt_tokens == len(head + tail)
    assert set(two.response.output_versions) == {version}

    client.set_final_reward(1.0)
    client.apply_reward_discount(0.5)
    assert [one.reward, two.reward] == [0.5, 1.0]
    concat = client.export_batch("concat", group_id=7)
    n = len(head + tail) + two.response.output_len
    assert concat["input_ids"].shape == (1, n) and concat["rewards"].tolist() == [1.0]
    trained = concat["loss_mask"][0].nonzero().flatten().tolist()
    first_span = list(range(len(expected_first), len(expected_first) + one.response.output_len))
    second_span = list(range(len(head + tail), n))
    assert trained == first_span + second_span  # both turns' generated tokens, nothing else
    torch.testing.assert_close(concat["logprobs"][0, second_span],
                               torch.tensor(two.response.output_logprobs), rtol=0, atol=0)
    individual = client.export_batch("individual")
    assert individual["rewards"].tolist() == [0.5, 1.0]
    assert individual["loss_mask"].sum(dim=1).tolist() == [one.response.output_len,
                                                           two.response.output_len]


class ScriptedEngine:
    """Answers each request with the next scripted text (token ids of the tokenizer)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    async def agenerate(self, req):
        self.prompts.append(list(req.input_ids))
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return ModelResponse(list(req.input_ids), ids, [-0.5] * len(ids), [3] * len(ids))


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]


def test_tool_calls_come_back_as_openai_objects_and_results_continue_the_ids(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [f"Let me add. {call}", "42"])
    client = ArealOpenAI(engine, tokenizer)

    async def agent():
        messages = [{"role": "user", "content": "12 + 30 ="}]
        first = await client.chat.completions.create(model="m", messages=messages,
                                                     tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert message.content == "Let me add."
        (tool_call,) = message.tool_calls
        assert tool_call.function.name == "add"
        assert json.loads(tool_call.function.arguments) == {"a": 12, "b": 30}
        messages += [message, {"role": "tool", "tool_call_id": tool_call.id, "content": "42"}]
        return await client.chat.completions.create(model="m", messages=messages,
                                                    tools=TOOLS)

    final = asyncio.run(agent())
    assert final.choices[0].message.content == "42"
    assert final.choices[0].message.tool_calls is None
    one, two = client.completions
    assert two.parent is one and engine.prompts[1][:len(one.builder)] == one.builder.input_ids
    client.set_reward(one.id, 0.25)
    client.set_reward(two.id, 1.0)
    assert client.export_batch("individual")["rewards"].tolist() == [0.25, 1.0]


def test_unsupported_arguments_and_missing_rewards_are_errors(tokenizer):
    client = ArealOpenAI(ScriptedEngine(tokenizer, ["a", "b"]), tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match=r"create\(n=2\) is not supported"):
        asyncio.run(client.chat.completions.create(model="m", messages=messages, n=2))
    with pytest.raises(TypeError, match=r"create\(stream=True\)"):
        asyncio.run(client.chat.completions.create(model="m", messages=messages, stream=True))
    with pytest.raises(ValueError, match="made no chat.completions.create call"):
        client.set_final_reward(1.0)
    done = asyncio.run(client.chat.completions.create(model="m", messages=messages))
    with pytest.raises(ValueError, match=rf"no reward for completion\(s\) \['{done.id}'\]"):
        client.export_batch()
    with pytest.raises(KeyError, match="no recorded completion 'nope'"):
        client.set_reward("nope", 1.0)
    with pytest.raises(ValueError, match=r"turn_discount=1.5"):
        client.apply_reward_discount(1.5)


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.sglang
@pytest.mark.e2e
def test_the_two_tool_openai_agent_trains_with_grpo(tiny_model_dir, tmp_path, fresh_fleet):
    """examples/openai_agent: agent code for openai.AsyncOpenAI as the workflow of a real
    asynchronous GRPO run (launcher, torchrun trainer, the session's SGLang fleet)."""
    import os
    import subprocess
    import sys

    from sglang_helpers import attach_args

    from areal_like.utils.metrics_logger import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "grpo", "--config",
         "examples/openai_agent/config.yaml", f"model.path={tiny_model_dir}",
         *attach_args(fresh_fleet),
         f"logging.log_dir={tmp_path}", "total_train_steps=2", "evaluation.freq_steps=100",
         "logging.tensorboard=false", "logging.plot=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = read_metrics(tmp_path / "openai_agent" / "trial0" / "metrics.jsonl")
    steps = [r for r in records if "actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["actor/task_reward/min"] >= 0.0 and r["actor/task_reward/max"] <= 1.0
               for r in steps)
