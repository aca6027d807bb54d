"""The Anthropic Messages API over a session's recording client.

A Messages request is converted to the chat messages `ArealOpenAI` records (a `tool_use` block
is an assistant tool call, a `tool_result` block a `tool` message), so both APIs share one
recorder and one chat-template path: a turn sent back as the API returned it extends the
earlier call's exact token ids. The reply is a `message` with `text` and `tool_use` blocks, or,
streamed, the API's events (`message_start` ... `message_stop`) sent after it is whole.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from workflows.gateway.openai_api import BadRequest

if TYPE_CHECKING:
    from workflows.openai_client import RecordedCompletion

# accepted and ignored: what the policy cannot honour and a client does not depend on (Claude
# Code sends `thinking`, `output_config` and `context_management`: no thinking blocks come
# back, the reply is not shaped by an effort level, and no context is edited server-side)
IGNORED_KEYS = ("metadata", "service_tier", "thinking", "output_config", "context_management")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# `system` inside `messages`: not in the Messages API's reference, but Claude Code sends it
ROLES = ("user", "assistant", "system")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content: expected a string or a list of content blocks",
                         f"{where}.content")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in ("text", "tool_use",
                                                                     "tool_result"):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where}.content[{i}]: only text, tool_use and tool_result "
                             f"blocks are served here (got {kind!r})", f"{where}.content")
    return content


def _text(blocks: list[dict[str, Any]]) -> str:
    return "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    text = content if isinstance(content, str) else _text(_blocks(content, where))
    return f"Error: {text}" if block.get("is_error") else text


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`system` + `messages` as chat messages (the recorder's plain dicts)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str)
                    else _text(_blocks(system, "system"))})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise BadRequest(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}",
                             f"{where}.role")
        blocks = _blocks(message.get("content"), where)
        if message["role"] == "system":  # (Claude Code sends its reminders so)
            out.append({"role": "system", "content": _text(blocks)})
            continue
        if message["role"] == "assistant":
            calls = [{"id": b.get("id", ""), "type": "function", "function": {
                "name": b.get("name", ""), "arguments": json.dumps(b.get("input", {}))}}
                for b in blocks if b["type"] == "tool_use"]
            turn: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
            continue
        for j, block in enumerate(blocks):  # tool results first, as the API orders them
            if block["type"] == "tool_result":
                if not block.get("tool_use_id"):
                    raise BadRequest(f"{where}.content[{j}]: a tool_result needs its "
                                     f"'tool_use_id'", f"{where}.content")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _tool_result_text(block, f"{where}.content[{j}]")})
        if any(b["type"] == "text" for b in blocks):
            out.append({"role": "user", "content": _text(blocks)})
    return out


def create_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `chat.completions.create` for a Messages request body."""
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        raise BadRequest("'max_tokens' (a positive integer) is required", "max_tokens")
    kwargs: dict[str, Any] = {"messages": chat_messages(body), "model": body.get("model", ""),
                              "max_tokens": body["max_tokens"]}
    tools = body.get("tools")
    if tools:
        try:
            kwargs["tools"] = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema", {})}} for t in tools]
        except (KeyError, TypeError):
            raise BadRequest("tools: each needs a 'name' (and an 'input_schema')",
                             "tools") from None
    choice = (body.get("tool_choice") or {}).get("type", "auto")
    if choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice.type={choice!r}: the policy chooses ('auto' or 'none')",
                         "tool_choice")
    kwargs["tool_choice"] = choice
    if body.get("stop_sequences"):
        kwargs["stop"] = list(body["stop_sequences"])
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            kwargs[key] = body[key]
    known = ("model", "max_tokens", "messages", "system", "tools", "tool_choice",
             "stop_sequences", "temperature", "top_p", "stream", *IGNORED_KEYS)
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise BadRequest(f"{', '.join(unknown)}: not supported by the training gateway "
                         f"(supported: {', '.join(known[:-len(IGNORED_KEYS)])})", unknown[0])
    return kwargs


def message_json(completion: Any, record: RecordedCompletion) -> dict[str, Any]:
    """The `message` object of a reply."""
    choice = completion.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or ():
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                        "input": json.loads(call.function.arguments)})
    return {"id": "msg_" + completion.id.removeprefix("chatcmpl-"), "type": "message",
            "role": "assistant", "model": completion.model, "content": content,
            "stop_reason": ("stop_sequence" if record.stop_sequence is not None
                            else STOP_REASONS[choice.finish_reason]),
            "stop_sequence": record.stop_sequence,
            "usage": {"input_tokens": record.prompt_len,
                      "output_tokens": len(record.completion_ids)}}


def message_events(reply: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The streamed events of a whole reply: (event name, data)."""
    start = {**reply, "content": [], "stop_reason": None,
             "usage": {**reply["usage"], "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start",
                                                                   "message": start})]
    for index, block in enumerate(reply["content"]):
        if block["type"] == "text":
            opened: dict[str, Any] = {"type": "text", "text": ""}
            delta: dict[str, Any] = {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": opened}),
                   ("content_block_delta", {"type": "content_block_delta", "index": index,
                                            "delta": delta}),
                   ("content_block_stop", {"type": "content_block_stop", "index": index})]
    events += [("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": reply["stop_reason"],
                                            "stop_sequence": reply["stop_sequence"]},
                                  "usage": {"output_tokens": reply["usage"]["output_tokens"]}}),
               ("message_stop", {"type": "message_stop"})]
    return events


def error_body(message: str, kind: str, param: Optional[str] = None) -> dict[str, Any]:
    del param  # the API's error object names no parameter: the message does
    return {"type": "error", "error": {"type": kind, "message": message}}
