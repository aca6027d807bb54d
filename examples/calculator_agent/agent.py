"""The calculator agent: an ordinary program with its own loop, speaking the OpenAI Chat
Completions API over HTTP to whatever `OPENAI_BASE_URL` names (here, the trainer's gateway),
running the model's Python in the sandbox. It knows nothing of training.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... AREAL_LIKE_ITEM='{"question": "What is 12 * 3?"}' \
        python examples/calculator_agent/agent.py

It asks the question with a `python` tool; each tool call's code runs in the sandbox (no
network, no files, CPU and wall-clock limits) and its output goes back as the tool's reply;
the first reply without a tool call is the answer, written to `answer.txt`. Plain HTTP from
the standard library, not the `openai` package: its import takes ~1.3 s, paid by every episode
(the SDKs themselves are tested against the gateway in tests/test_agent_gateway.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from pathlib import Path

from areal_like.utils.sandbox import Sandbox, SandboxLimits

MAX_TURNS = 3
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


def chat(messages: list[dict]) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode(),
        headers={"Content-Type": "application/json",
                 "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.load(reply)["choices"][0]["message"]


def run_tool(sandbox: Sandbox, call: dict) -> str:
    try:
        code = json.loads(call["function"]["arguments"]).get("code", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: the arguments are not a JSON object with 'code'"
    result = asyncio.run(sandbox.run_python(str(code)))
    if result.timed_out:
        return "error: the code ran past its time limit"
    return result.stdout if result.exit_code == 0 else f"error: {result.stderr[-500:]}"


def main() -> int:
    item = json.loads(os.environ["AREAL_LIKE_ITEM"])
    # the work is bounded by CPU time; the wall-clock limit only catches a hang (a held-out
    # evaluation runs every question's program at once: on a busy machine, queueing for a
    # core must not time the code out)
    sandbox = Sandbox(SandboxLimits(wall_s=120, cpu_s=5, memory_mb=256))
    messages: list[dict] = [{"role": "user", "content": item["question"]}]
    answer = ""
    for _ in range(MAX_TURNS):
        message = chat(messages)
        calls = message.get("tool_calls") or []
        if not calls:
            answer = message.get("content") or ""
            break
        messages.append(message)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": run_tool(sandbox, call)})
    Path("answer.txt").write_text(answer)
    print(json.dumps({"turns": sum(m["role"] == "assistant" for m in messages) + 1,
                      "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
