"""An OpenAI-compatible chat client backed by our inference engine, recording every call.

Agent code written for `openai.AsyncOpenAI` runs unchanged inside a workflow:

    completion = await client.chat.completions.create(model="policy", messages=msgs,
                                                      tools=TOOLS)
    msg = completion.choices[0].message        # .content, .tool_calls[i].function.arguments

Each call is recorded token-in/token-out: its prompt ids, completion ids, log-probs and
per-token policy versions. When a call's messages extend an earlier call's messages plus the
assistant message it returned, the prompt reuses that call's exact ids (prompt + completion)
and only the messages after it are rendered and tokenized — no re-tokenization drift between
turns. Rewards are set per completion (`set_reward`) or per trajectory (`set_final_reward`
and `apply_reward_discount`), and `export_batch` turns the recorded calls into trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageToolCallUnion,
)
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_tool_call import (
    ChatCompletionMessageToolCall,
    Function,
)
from openai.types.completion_usage import CompletionUsage
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    validate_trajectory,
)
from areal_like.utils.batching import concat_padded
from areal_like.utils.chat import decode_text, render_chat
from workflows.common import TrajectoryBuilder, with_eos_stop
from workflows.tools import TOOL_CALL_RE, parse_tool_calls

_TOKENIZER_LOCK = threading.Lock()  # prompts are tokenized in worker threads (see _create)

_UNSUPPORTED = {"stream": False, "n": 1, "logprobs": None, "top_logprobs": None, "seed": None,
                "response_format": None, "functions": None, "function_call": None,
                "parallel_tool_calls": None, "frequency_penalty": None,
                "presence_penalty": None, "logit_bias": None}


def _drop_if_parsed(block: re.Match[str]) -> str:
    return "" if parse_tool_calls(block.group(0))[0].error is None else block.group(0)


def _message_dict(message: Any) -> dict[str, Any]:
    """The fields of a chat message that the template and the turn matching read."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict) or "role" not in message:
        raise TypeError(f"chat message {message!r}: expected a dict with a 'role' (or an "
                        f"openai message object)")
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": {
            "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat templates take tool-call arguments as objects, the OpenAI API sends JSON text."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls", ()):
            args = call["function"]["arguments"]
            if isinstance(args, str):
                with contextlib.suppress(json.JSONDecodeError):  # else rendered as the text
                    call["function"]["arguments"] = json.loads(args)
    return out


@dataclass
class RecordedCompletion:
    """One `chat.completions.create` call, as sent and generated."""

    id: str
    messages: list[dict[str, Any]]  # as sent (normalized)
    assistant: dict[str, Any]  # the message returned (normalized)
    builder: TrajectoryBuilder  # prompt (earlier turns' tokens kept) + this generation
    prompt_len: int
    response: ModelResponse
    parent: Optional[RecordedCompletion] = None
    reward: Optional[float] = None
    extended: bool = False  # a later call continued this conversation
    created: float = field(default_factory=time.monotonic)
    stop_sequence: Optional[str] = None  # the `stop` string that ended it (cut from its text)

    @property
    def prompt_ids(self) -> list[int]:
        return self.builder.input_ids[:self.prompt_len]

    @property
    def completion_ids(self) -> list[int]:
        return list(self.response.output_tokens)


def cut_at_stop(text: str, stops: Optional[list[str]]) -> tuple[str, Optional[str]]:
    """`text` up to the first of `stops` in it, and that stop (the last token may reach past
    it); unchanged, None, where none is in it (the reply ended on a stop token)."""
    found = [(text.find(s), s) for s in stops or () if s and s in text]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


class _Completions:
    def __init__(self, client: ArealOpenAI) -> None:
        self._client = client

    async def create(self, *, messages: list[Any], model: str = "policy",
                     tools: Optional[list[dict[str, Any]]] = None, tool_choice: Any = "auto",
                     temperature: Optional[float] = None, top_p: Optional[float] = None,
                     max_tokens: Optional[int] = None,
                     max_completion_tokens: Optional[int] = None,
                     stop: Optional[str | list[str]] = None, **other: Any) -> ChatCompletion:
        """`openai.AsyncOpenAI().chat.completions.create`, generated by the policy."""
        for key, value in other.items():
            if key not in _UNSUPPORTED or value != _UNSUPPORTED[key]:
                raise TypeError(f"chat.completions.create({key}={value!r}) is not supported "
                                f"by the training client (supported: messages, model, tools, "
                                f"tool_choice, temperature, top_p, max_tokens, "
                                f"max_completion_tokens, stop)")
        if tool_choice not in ("auto", "none", None):
            raise TypeError(f"tool_choice={tool_choice!r}: the policy chooses ('auto' or "
                            f"'none')")
        changes: dict[str, Any] = {"n_samples": 1}
        if temperature is not None:
            changes["temperature"] = temperature
        if top_p is not None:
            changes["top_p"] = top_p
        if max_completion_tokens is not None or max_tokens is not None:
            changes["max_new_tokens"] = max_completion_tokens or max_tokens
        if stop is not None:
            changes["stop"] = [stop] if isinstance(stop, str) else list(stop)
        return await self._client._create(
            [_message_dict(m) for m in messages], model,
            tools if tool_choice != "none" else None, self._client.gconfig.new(**changes))


class _Chat:
    def __init__(self, client: ArealOpenAI) -> None:
        self.completions = _Completions(client)


class ArealOpenAI:
    """The `openai.AsyncOpenAI` surface an agent uses (`chat.completions.create`), backed by
    `engine`, recording each call for training (see the module doc). One client per episode."""

    def __init__(self, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                 gconfig: Optional[GenerationHyperparameters] = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.gconfig = with_eos_stop(gconfig or GenerationHyperparameters(), tokenizer)
        self.chat = _Chat(self)
        self.completions: list[RecordedCompletion] = []  # in call order
        # every call of this client (one conversation, one episode) is routed by one key: the
        # fleet client keeps it on one server, whose prefix cache holds the earlier turns
        self.rid = f"chat-{uuid.uuid4().hex}"
        self.n_rerendered = 0  # extended calls whose template did not allow reusing the ids

    # ---- generation ---------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                add_generation_prompt: bool) -> str:
        extra = {"tools": tools} if tools else {}
        return render_chat(self.tokenizer, _for_template(messages), add_generation_prompt,
                           **extra)

    def _parent(self, messages: list[dict[str, Any]]) -> Optional[RecordedCompletion]:
        """The latest call whose messages + reply are where `messages` start."""
        best = None
        for rec in self.completions:
            head = [*rec.messages, rec.assistant]
            longest = best is None or len(head) >= len(best.messages) + 1
            if longest and len(head) <= len(messages) and messages[:len(head)] == head:
                best = rec
        return best

    def _prompt(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]
                ) -> tuple[TrajectoryBuilder, Optional[RecordedCompletion]]:
        full = self._render(messages, tools, True)
        parent = self._parent(messages)
        if parent is not None:
            head = self._render([*parent.messages, parent.assistant], tools, False)
            asked = self._render(parent.messages, tools, True)
            if full.startswith(head) and head.startswith(asked):
                builder = copy.deepcopy(parent.builder)
                eos = self.tokenizer.eos_token_id
                if eos is not None and (not builder.input_ids or builder.input_ids[-1] != eos):
                    builder.add_context([eos])  # close a turn cut by max_tokens or a stop
                # what the template puts after the reply's end of turn (e.g. ChatML's "\n")
                reply = head[len(asked):]
                eos_text = decode_text(self.tokenizer, [eos]) if eos is not None else ""
                tail = reply[reply.rfind(eos_text) + len(eos_text):] if eos_text in reply else ""
                builder.add_context(self._encode(tail + full[len(head):]))
                return builder, parent
            self.n_rerendered += 1
        return TrajectoryBuilder(self._encode(full)), None

    def _encode(self, text: str) -> list[int]:
        with _TOKENIZER_LOCK:  # a fast tokenizer is not to be used by two threads at once
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    async def _create(self, messages: list[dict[str, Any]], model: str,
                      tools: Optional[list[dict[str, Any]]],
                      gconfig: GenerationHyperparameters) -> ChatCompletion:
        # rendered and tokenized beside the event loop: a long prompt (the gateway's callers
        # send what they like) does not hold up the other episodes' calls
        builder, parent = await asyncio.to_thread(self._prompt, messages, tools)
        prompt_len = len(builder)
        resp = await self.engine.agenerate(ModelRequest(input_ids=list(builder.input_ids),
                                                        gconfig=gconfig, rid=self.rid))
        builder.add_generation(resp)
        text = decode_text(self.tokenizer, resp.output_tokens, skip_special_tokens=True)
        # the APIs return the text before the stop string that ended it (its tokens are
        # recorded and trained all the same: the policy generated them)
        text, matched = (cut_at_stop(text, gconfig.stop) if resp.stop_reason == "stop"
                         else (text, None))
        calls = [c for c in parse_tool_calls(text) if c.error is None] if tools else []
        # a block that does not parse stays in the text, as the servers' own parsers leave it
        content = TOOL_CALL_RE.sub(_drop_if_parsed, text).strip() if calls else text
        tool_calls: list[ChatCompletionMessageToolCallUnion] = [ChatCompletionMessageToolCall(
            id=f"call_{uuid.uuid4().hex[:12]}", type="function",
            function=Function(name=c.name, arguments=json.dumps(c.arguments))) for c in calls]
        message = ChatCompletionMessage(role="assistant", content=content,
                                        tool_calls=tool_calls or None)
        finish: Literal["tool_calls", "length", "stop"] = ("tool_calls" if calls else
                  "length" if resp.stop_reason == "length" else "stop")
        completion = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
            model=model, choices=[Choice(index=0, finish_reason=finish, message=message)],
            usage=CompletionUsage(prompt_tokens=prompt_len, completion_tokens=resp.output_len,
                                  total_tokens=prompt_len + resp.output_len))
        self.completions.append(RecordedCompletion(
            completion.id, messages, _message_dict(message), builder, prompt_len, resp, parent,
            stop_sequence=matched))
        if parent is not None:  # only now: a call that failed continued nothing, and its
            parent.extended = True  # parent stays a conversation of its own in the export
        return completion

    # ---- rewards ------------------------------------------------------------------------
    def _get(self, completion_id: str) -> RecordedCompletion:
        for rec in self.completions:
            if rec.id == completion_id:
                return rec
        raise KeyError(f"no recorded completion {completion_id!r} (this client made "
                       f"{len(self.completions)})")

    def set_reward(self, completion_id: str, reward: float) -> None:
        """The reward of one completion (by `ChatCompletion.id`)."""
        self._get(completion_id).reward = float(reward)

    def set_final_reward(self, reward: float) -> None:
        """The reward of the last completion (the trajectory's outcome)."""
        if not self.completions:
            raise ValueError("set_final_reward: the agent made no chat.completions.create call")
        self.completions[-1].reward = float(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """Returns-to-go over the calls in order: G_i = r_i + turn_discount * G_{i+1}, an
        unset r_i counting as 0; every completion's reward becomes its G_i."""
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"turn_discount={turn_discount!r}: expected a value in [0, 1]")
        future = 0.0
        for rec in reversed(self.completions):
            future = (rec.reward or 0.0) + turn_discount * future
            rec.reward = future

    # ---- export -------------------------------------------------------------------------
    def export_batch(self, style: str = "concat", **per_sequence: Any) -> TensorDict:
        """The recorded calls as trajectories: `individual`, a row per call (its prompt and
        completion); `concat`, a row per conversation (the last call of each chain, whose
        prompt holds the earlier calls' tokens, all trained). Every exported call needs a
        reward; `per_sequence` values (e.g. group_id) go on every row."""
        if style not in ("individual", "concat"):
            raise ValueError(f"export_batch(style={style!r}): expected 'individual' or 'concat'")
        rows = [r for r in self.completions if style == "individual" or not r.extended]
        if not rows:
            raise ValueError("export_batch: the agent made no chat.completions.create call")
        unset = [r.id for r in rows if r.reward is None]
        if unset:
            raise ValueError(f"export_batch: no reward for completion(s) {unset}; call "
                             f"set_reward / set_final_reward (+ apply_reward_discount)")
        out = []
        for rec in rows:
            builder = rec.builder
            if style == "individual" and rec.parent is not None:  # train only this call
                builder = TrajectoryBuilder(rec.prompt_ids)
                builder.add_generation(rec.response)
            assert rec.reward is not None  # checked above
            out.append(builder.to_tensordict(rec.reward, **per_sequence))
        return validate_trajectory(concat_padded(out))
