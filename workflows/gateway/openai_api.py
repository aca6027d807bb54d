"""The OpenAI Chat Completions API over a session's recording client.

A request body becomes one `ArealOpenAI.chat.completions.create` call (so the gateway records
exactly what an in-process agent's client records); its `ChatCompletion` becomes the JSON
reply, or, with `stream: true`, a short series of `chat.completion.chunk` server-sent events
ending in `[DONE]`. The reply is streamed after it is whole: training needs its token ids,
log-probabilities and versions, which come with the whole reply.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from areal_like.utils.chat import decode_text, token_bytes
from workflows.tools import parse_tool_calls

if TYPE_CHECKING:
    from workflows.openai_client import ArealOpenAI, RecordedCompletion

ROLES = ("system", "developer", "user", "assistant", "tool")
# accepted and without effect here: bookkeeping of the caller, or a choice the policy makes
IGNORED_KEYS = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")
# the gateway's own: how the reply is sent, not what is generated
GATEWAY_KEYS = ("messages", "stream", "stream_options", "logprobs", "top_logprobs")


class BadRequest(ValueError):
    """A request the API refuses (HTTP 400), naming the parameter at fault."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}.content[{i}]: only text parts are served here "
                                 f"(got {kind!r})", f"{where}.content")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise BadRequest(f"{where}.content: expected a string or a list of text parts, got "
                     f"{type(content).__name__}", f"{where}.content")


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's `messages`, checked, as the recorder's plain dicts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of chat messages", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where}: expected an object, got {type(message).__name__}", where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}",
                             f"{where}.role")
        parsed: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                  "content": _text_content(message.get("content"), where)}
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls: a list, on assistant messages only",
                                 f"{where}.tool_calls")
            try:
                parsed["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                    for c in calls]
            except (KeyError, TypeError, AttributeError):
                raise BadRequest(f"{where}.tool_calls: each needs function.name and "
                                 f"function.arguments", f"{where}.tool_calls") from None
        if role == "tool":
            if not message.get("tool_call_id"):
                raise BadRequest(f"{where}: a tool message needs its 'tool_call_id'",
                                 f"{where}.tool_call_id")
            parsed["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            parsed["name"] = message["name"]
        out.append(parsed)
    return out


def create_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `chat.completions.create` for a request body (without the
    gateway's own keys: stream, stream_options, logprobs, top_logprobs)."""
    kwargs: dict[str, Any] = {"messages": parse_messages(body.get("messages"))}
    # the rest as sent: the recorder refuses what it does not support, naming it
    kwargs.update((k, v) for k, v in body.items() if k not in (*IGNORED_KEYS, *GATEWAY_KEYS))
    if kwargs.get("n", 1) != 1:
        raise BadRequest(f"n={kwargs['n']!r}: one choice per request (each is an episode's "
                         f"turn)", "n")
    kwargs.pop("n", None)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false", "stream")
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs: only the chosen token's log-probability is served "
                         "('logprobs': true)", "top_logprobs")
    return kwargs


def invalid_tool_calls(record: RecordedCompletion, client: ArealOpenAI) -> int:
    """Tool calls the model emitted that do not parse (returned as text, as the API would)."""
    text = decode_text(client.tokenizer, record.completion_ids, skip_special_tokens=True)
    return sum(1 for call in parse_tool_calls(text) if call.error is not None)


def _logprobs(record: RecordedCompletion, client: ArealOpenAI) -> dict[str, Any]:
    content = []
    pairs = zip(record.completion_ids, record.response.output_logprobs, strict=True)
    for token_id, logprob in pairs:
        token = decode_text(client.tokenizer, [token_id])
        content.append({"token": token, "logprob": float(logprob),
                        "bytes": list(token_bytes(client.tokenizer, token_id)),
                        "top_logprobs": []})
    return {"content": content}


def completion_json(completion: Any, record: RecordedCompletion, client: ArealOpenAI,
                    logprobs: bool) -> dict[str, Any]:
    """The `chat.completion` object of a reply."""
    out: dict[str, Any] = completion.model_dump(mode="json", exclude_none=True)
    out["choices"][0]["message"].setdefault("content", "")
    out["choices"][0]["logprobs"] = _logprobs(record, client) if logprobs else None
    return out


def completion_chunks(reply: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` events of a whole reply: role and text, tool calls, the
    finish reason (and the usage when asked for)."""
    choice = reply["choices"][0]
    message = choice["message"]
    head = {"id": reply["id"], "object": "chat.completion.chunk",
            "created": reply.get("created", int(time.time())), "model": reply["model"]}

    def chunk(delta: dict[str, Any], finish: Optional[str] = None,
              logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": logprobs}]}

    chunks = [chunk({"role": "assistant", "content": message.get("content") or ""},
                    logprobs=choice.get("logprobs"))]
    if message.get("tool_calls"):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}
                                            for i, call in enumerate(message["tool_calls"])]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": reply["usage"]})
    return chunks
