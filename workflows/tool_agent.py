"""A tool-using agent: generate, execute tool calls, feed results back, until an answer."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    RolloutWorkflow,
    validate_trajectory,
)
from areal_like.rewards.reward_executor import RewardExecutor, UsesRewards
from areal_like.utils.chat import decode_text, render_chat
from workflows.common import (
    TrajectoryBuilder,
    chat_prompt_ids,
    load_tokenizer,
    stable_id,
    with_eos_stop,
)
from workflows.tools import ToolCall, ToolRegistry, ToolResult, parse_tool_calls

# action_reward_fn(call, result, data) -> reward placed on the action's last token
ActionRewardFn = Callable[[ToolCall, ToolResult, dict[str, Any]], float]


def tool_success_reward(call: ToolCall, result: ToolResult, data: dict[str, Any]) -> float:
    return 1.0 if result.ok else 0.0


@dataclass
class Turn:
    """One generated assistant turn: where its last token is, and the calls it made."""

    end: int
    calls: list[tuple[ToolCall, ToolResult]]


@dataclass
class Conversation:
    """One agent conversation as tokens, plus what happened in it."""

    builder: TrajectoryBuilder
    actions: list[tuple[ToolCall, ToolResult, int]] = field(default_factory=list)  # (.., pos)
    turns: list[Turn] = field(default_factory=list)  # generated turns (not scripted ones)
    final_text: str = ""


class ToolAgentWorkflow(RolloutWorkflow, UsesRewards):
    """Multi-step tool use, token-in/token-out, one trajectory row per conversation.

    Per-action rewards (from `action_reward_fn`, times `action_reward_weight`) are placed on
    the last token of the action in the dense `action_rewards` [1, L] key; `rewards` is the
    outcome reward `reward_fn(prompt, final answer, **data)` plus their sum. A data item may
    carry `scripted_actions`: assistant texts inserted (not trained on) before the model acts.
    """

    def __init__(
        self,
        tools: ToolRegistry,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer: PreTrainedTokenizerBase | str,
        max_steps: int = 4,
        action_reward_fn: ActionRewardFn = tool_success_reward,
        action_reward_weight: float = 0.1,
        reward_executor: Optional[RewardExecutor] = None,
    ) -> None:
        self.tools = tools
        self.reward_fn = reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = with_eos_stop(gconfig.new(n_samples=1), self.tokenizer)
        self.max_steps = max_steps
        self.action_reward_fn = action_reward_fn
        self.action_reward_weight = action_reward_weight
        self.use_rewards(reward_fn, reward_executor)  # else the episode's (see UsesRewards)
        self.n_tool_errors = 0

    def _tool_message_ids(self, results: list[ToolResult]) -> list[int]:
        messages = [{"role": "tool", "content": r.render()} for r in results]
        text = render_chat(self.tokenizer, messages)
        return self.tokenizer.encode("\n" + text, add_special_tokens=False)

    def _close_turn(self, builder: TrajectoryBuilder) -> None:
        if not builder.input_ids or builder.input_ids[-1] != self.tokenizer.eos_token_id:
            builder.add_context([self.tokenizer.eos_token_id])

    async def run_conversation(
        self,
        engine: InferenceEngine,
        messages: list[dict[str, str]],
        tools: ToolRegistry,
        scripted_actions: tuple[str, ...] = (),
        rid: str = "",
        system: Optional[str] = None,
    ) -> Conversation:
        """`system` replaces the tools' own description as the system prompt."""
        system_msg = {"role": "system", "content": system or tools.describe()}
        conv = Conversation(TrajectoryBuilder(chat_prompt_ids(self.tokenizer,
                                                              [system_msg, *messages])))
        builder = conv.builder
        for step in range(self.max_steps + len(scripted_actions)):
            if step < len(scripted_actions):
                ids = self.tokenizer.encode(scripted_actions[step], add_special_tokens=False)
                builder.add_context(ids + [self.tokenizer.eos_token_id])
                text = scripted_actions[step]
            else:
                resp = await engine.agenerate(ModelRequest(
                    input_ids=list(builder.input_ids), gconfig=self.gconfig,
                    rid=f"{rid or 'agent'}-{uuid.uuid4().hex[:12]}-{step}",
                ))
                builder.add_generation(resp)
                text = decode_text(self.tokenizer, resp.output_tokens, skip_special_tokens=True)
            calls = parse_tool_calls(text)
            results = [await tools.call(c) for c in calls]
            if step >= len(scripted_actions):
                conv.turns.append(Turn(len(builder) - 1, list(zip(calls, results, strict=True))))
            if not calls:
                conv.final_text = text
                break
            self.n_tool_errors += sum(not r.ok for r in results)
            for call, result in zip(calls, results, strict=True):
                conv.actions.append((call, result, len(builder) - 1))
            self._close_turn(builder)
            builder.add_context(self._tool_message_ids(results))
        return conv

    def to_trajectory(self, conv: Conversation, outcome: float, data: dict[str, Any],
                      action_reward_fn: Optional[ActionRewardFn] = None,
                      action_reward_weight: Optional[float] = None,
                      **per_sequence: float | int) -> TensorDict:
        reward_fn = action_reward_fn or self.action_reward_fn
        weight = self.action_reward_weight if action_reward_weight is None else action_reward_weight
        dense = torch.zeros(len(conv.builder))
        for call, result, pos in conv.actions:
            dense[pos] += weight * reward_fn(call, result, data)
        total = outcome + float(dense.sum())
        td = conv.builder.to_tensordict(
            total, action_rewards=dense, outcome_rewards=outcome,
            num_actions=len(conv.actions), **per_sequence,
        )
        return validate_trajectory(td)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        group_id = stable_id(data.get("id", data["messages"][-1]["content"]))
        conv = await self.run_conversation(
            engine, data["messages"], self.tools, tuple(data.get("scripted_actions", ())),
            rid=f"agent-{group_id}",
        )
        prompt = data["messages"][-1]["content"]
        outcome = await self.reward_executor(self.reward_fn, prompt, conv.final_text, **data)
        return self.to_trajectory(conv, outcome, data, group_id=group_id)
