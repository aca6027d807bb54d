"""A 2-tool agent written against the OpenAI client, trained with GRPO.

`solve` is plain `openai.AsyncOpenAI` code: pointed at an OpenAI-compatible server it runs as
it is; inside training it gets our `ArealOpenAI`, which records every call token-in/token-out
for the trainer. Train it (from the repository root):

    python -m areal_like.launcher.local grpo --config examples/openai_agent/config.yaml \
        model.path=<model folder>
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from workflows import OpenAIAgentWorkflow

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name} two integers",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    for name in ("add", "multiply")
]
FUNCTIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}
MAX_TURNS = 3


async def solve(client: AsyncOpenAI, data: dict[str, Any]) -> float:
    """Answer the question, calling the tools as the model decides; 1.0 when right."""
    messages: list[Any] = [{"role": "system", "content": "Tools: add, multiply."},
                           *data["messages"]]
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=16)
        message = completion.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = FUNCTIONS[call.function.name](**json.loads(call.function.arguments))
            except (KeyError, TypeError, ValueError) as e:  # the model sees its mistake
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return 1.0 if (message.content or "").strip() == str(data["answer"]) else 0.0


class CalculatorAgentWorkflow(OpenAIAgentWorkflow):
    """`solve` as a workflow, built the way `rollout.workflow=` builds one."""

    def __init__(self, reward_fn: Any, gconfig: Any, tokenizer: Any) -> None:
        super().__init__(solve, gconfig, tokenizer, turn_discount=0.9)
