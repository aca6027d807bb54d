"""Tools for agent workflows: a registry of async callables and the tool-call text format.

Format (Qwen/Hermes style), one or more per assistant turn:

    <tool_call>{"name": "memory_insert", "arguments": {"content": "Alice likes tea"}}</tool_call>

Results go back to the model as a `tool` chat message holding a JSON object
`{"name": ..., "ok": true|false, "result" | "error": ...}`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None  # set when the call text could not be parsed

    def render(self) -> str:
        body = json.dumps({"name": self.name, "arguments": self.arguments})
        return f"<tool_call>{body}</tool_call>"


@dataclass
class ToolResult:
    name: str
    ok: bool
    content: Any

    def render(self) -> str:
        key = "result" if self.ok else "error"
        return json.dumps({"name": self.name, "ok": self.ok, key: self.content}, default=str)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`; malformed ones come back with `error` set."""
    calls = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name="", error=f"invalid JSON in tool call: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(name="", error="tool call needs a string 'name'"))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error="'arguments' must be an object"))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls


ToolFn = Callable[..., Awaitable[Any]]


class ToolRegistry:
    """Named async tools. A tool raising an exception yields a failed `ToolResult` (the model
    sees the error, the episode goes on); every call is bounded by `timeout` seconds."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._tools: dict[str, tuple[ToolFn, str]] = {}

    def register(self, fn: Optional[ToolFn] = None, *, name: Optional[str] = None,
                 description: str = "") -> Any:
        def add(f: ToolFn) -> ToolFn:
            if not inspect.iscoroutinefunction(f):
                raise TypeError(f"tool {f.__name__!r} must be an async function")
            tool_name = name or f.__name__
            self._tools[tool_name] = (f, description or (f.__doc__ or "").strip())
            return f

        return add(fn) if fn is not None else add

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def describe(self) -> str:
        """A system-prompt paragraph listing the tools and the call format."""
        lines = ["You can call tools. Write each call as",
                 '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>', "Tools:"]
        for tool_name in self.names:
            fn, doc = self._tools[tool_name]
            params = ", ".join(inspect.signature(fn).parameters)
            lines.append(f"- {tool_name}({params}): {doc}")
        return "\n".join(lines)

    async def call(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name, False, call.error)
        if call.name not in self._tools:
            return ToolResult(call.name, False, f"unknown tool {call.name!r}; known: {self.names}")
        fn, _ = self._tools[call.name]
        try:
            value = await asyncio.wait_for(fn(**call.arguments), timeout=self.timeout)
        except TypeError as e:  # wrong argument names from the model
            return ToolResult(call.name, False, f"bad arguments: {e}")
        except asyncio.TimeoutError:
            return ToolResult(call.name, False, f"timed out after {self.timeout}s")
        except Exception as e:  # reported to the model, and counted by the workflow
            return ToolResult(call.name, False, f"{type(e).__name__}: {e}")
        return ToolResult(call.name, True, value)
