"""What an agent receives when the model's tool call does not parse, through the gateway's real
HTTP server and the official SDKs, the model's replies scripted (the one thing a real server
cannot be made to produce on demand): the block comes back as text, as SGLang's and vLLM's
own tool parsers leave it, beside the calls that do parse; the gateway counts it; the turn is
recorded token for token all the same."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from test_openai_client import ScriptedEngine
from transformers import AutoTokenizer

from workflows.gateway import AgentGateway

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
BROKEN = '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'  # trailing comma
GOOD = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_tool_call_that_is_not_json_reaches_the_agent_as_text_and_is_counted(tokenizer):
    replies = [f"Adding. {BROKEN}", f"{GOOD} then {BROKEN}", f"Adding. {BROKEN}"]
    engine = ScriptedEngine(tokenizer, replies)
    gateway = AgentGateway(engine, tokenizer)  # type: ignore[arg-type]

    async def agent() -> tuple[object, object, object]:
        await gateway.start()
        try:
            session = gateway.open_session()
            sdk = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k",
                                     timeout=60)
            ask = [{"role": "user", "content": "12 + 30 ="}]
            broken = await sdk.chat.completions.create(model="policy", messages=ask,
                                                       tools=TOOLS)
            mixed = await sdk.chat.completions.create(model="policy", messages=ask,
                                                      tools=TOOLS)
            claude = anthropic.AsyncAnthropic(base_url=gateway.session_root(session),
                                              api_key="k", timeout=60)
            message = await claude.messages.create(
                model="policy", max_tokens=16, messages=[{"role": "user", "content": "1 + 2"}],
                tools=[{"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}])
            await gateway.close_session(session.key)
            return broken, mixed, message
        finally:
            await gateway.stop()

    broken, mixed, message = asyncio.run(agent())
    # OpenAI: no tool call, the block as the model wrote it, an ordinary stop
    choice = broken.choices[0]  # type: ignore[attr-defined]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == f"Adding. {BROKEN}"
    # the call that parses is a tool call; the one that does not stays in the text
    choice = mixed.choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12,
                                                                                  "b": 30}
    assert choice.message.content == f"then {BROKEN}"
    # Anthropic: a text block, no tool_use, end_turn
    assert [b.type for b in message.content] == ["text"]  # type: ignore[attr-defined]
    assert message.content[0].text == f"Adding. {BROKEN}"  # type: ignore[attr-defined]
    assert message.stop_reason == "end_turn"  # type: ignore[attr-defined]
    assert gateway.sessions.counts["invalid_tool_calls"] == 3
    assert gateway.sessions.counts["calls"] == 3
