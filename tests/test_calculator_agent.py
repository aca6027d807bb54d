"""The calculator agent (examples/calculator_agent), a program of its own, end to end through
the gateway and the sandbox, with the model's replies scripted (the untrained test model
never writes a tool call): its tool call's code runs in bubblewrap and the output is the
tool's reply in the next turn's prompt; the answer it writes is scored by the task's
verifier; code that tries to leave the sandbox gets an error back and the episode goes on.
(The recipe's loop on the real fleet: tests/test_recipes.py; its learning curve:
docs/agents.md.)"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
from test_openai_client import ScriptedEngine
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from examples.calculator_agent.task import make_task, score, tool_call_text
from workflows.program import ProgramWorkflow

AGENT = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent" / "agent.py"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap missing (scripts/install.sh installs it)")


def _episode(tokenizer, replies: list[str], item: dict):
    engine = ScriptedEngine(tokenizer, replies)
    workflow = ProgramWorkflow([sys.executable, str(AGENT)], score,
                               GenerationHyperparameters(max_new_tokens=80), tokenizer,
                               timeout_s=120)

    async def run():
        try:
            return await workflow.arun_episode(engine, item)  # type: ignore[arg-type]
        finally:
            await workflow.aclose()

    return asyncio.run(run()), engine


def test_the_agent_calls_the_sandboxed_tool_and_is_scored(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    item = make_task("test", 1, seed=3)[0]
    a, b = (int(x) for x in item["question"][len("What is "):-1].split(" * "))
    product = str(a * b)

    batch, engine = _episode(tokenizer, [tool_call_text(a, b), product], item)
    assert batch["rewards"].tolist() == [1.0]
    # the second call's prompt: the first call's exact ids, then the sandbox's output as the
    # tool's turn
    first, second = engine.prompts
    assert second[:len(first)] == first
    assert f"<|im_start|>tool\n{product}\n<|im_end|>" in tokenizer.decode(second)
    assert batch["loss_mask"].sum().item() > len(tokenizer.encode(tool_call_text(a, b)))

    guessed, _ = _episode(tokenizer, ["12345"], item)  # no tool call: a wrong guess
    assert guessed["rewards"].tolist() == [0.0]

    # code that reads a file of the machine or opens a socket gets an error as the tool's
    # reply; the agent goes on and answers
    escape = ("<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": "
              "\"import socket; socket.create_connection(('127.0.0.1', 22), 2); "
              "print(open('/etc/passwd').read())\"}}</tool_call>")
    _, engine = _episode(tokenizer, [escape, product], item)
    tool_turn = tokenizer.decode(engine.prompts[1]).rsplit("<|im_start|>tool\n", 1)[1]
    assert tool_turn.startswith("error: ") and "root:" not in tool_turn
