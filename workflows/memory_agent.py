"""A memory-building agent (Mem-alpha): read a conversation chunk by chunk, keep a memory with
tool calls, then answer the questions from that memory alone.

Each generated turn is an action a with reward  r_a = r1 + r2_a + beta * r3 + gamma * r4_a:
r1 = QA accuracy and r3 = compression (1 - memory / source length) are shared by every action
of the rollout; r2_a = the share of a's tool calls that succeeded and r4_a = the share that
stored words of the chunk being read are the action's own (a turn calling no tool scores 0 on
both). `areal_like.data.memory_episodes` generates the episodes (facts among chit-chat).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, validate_trajectory
from areal_like.data.memory_episodes import (
    MEMORY_SYSTEM,
    answer_from_memory,
    chunk_message,
    make_memory_episodes,  # noqa: F401 (re-export)
)
from areal_like.rewards.exact_match import extract_final_answer
from areal_like.utils.batching import concat_padded
from workflows.common import stable_id
from workflows.tool_agent import Conversation, ToolAgentWorkflow, Turn
from workflows.tools import ToolCall, ToolRegistry


class MemoryStore:
    """The agent's memory: numbered text entries."""

    def __init__(self) -> None:
        self.entries: dict[int, str] = {}
        self._next = 0

    def render(self) -> str:
        return "\n".join(f"[{i}] {t}" for i, t in sorted(self.entries.items())) or "(empty)"

    def registry(self, timeout: float = 5.0) -> ToolRegistry:
        tools = ToolRegistry(timeout=timeout)

        @tools.register(description="store a new memory; returns its id")
        async def memory_insert(content: str) -> int:
            if not str(content).strip():
                raise ValueError("content is empty")
            self._next += 1
            self.entries[self._next] = str(content).strip()
            return self._next

        @tools.register(description="replace the memory with this id")
        async def memory_update(id: int, content: str) -> int:  # noqa: A002 (the tool's API)
            if int(id) not in self.entries:
                raise KeyError(f"no memory with id {id}")
            self.entries[int(id)] = str(content).strip()
            return int(id)

        @tools.register(description="delete the memory with this id")
        async def memory_delete(id: int) -> int:  # noqa: A002
            if self.entries.pop(int(id), None) is None:
                raise KeyError(f"no memory with id {id}")
            return int(id)

        return tools


def content_validity(call: ToolCall, chunk: str) -> float:
    """1 when a memory write stores words that appear in the chunk being read, else 0."""
    if call.name not in ("memory_insert", "memory_update"):
        return 0.0
    words = str(call.arguments.get("content", "")).lower().split()
    return 1.0 if words and all(w.strip(".,") in chunk.lower() for w in words) else 0.0


ANSWERERS = ("retrieval", "policy")


class MemoryAgentWorkflow(ToolAgentWorkflow):
    """Data items: `chunks` (list of str), `questions` and `answers` (lists of str).

    Runs `gconfig.n_samples` rollouts of the item (Mem-alpha's n = 8), each in its own memory.
    A rollout gives one row per chunk conversation; each action's reward (module doc) sits on
    the action's last token in `action_rewards` [1, L]; `rewards` is the rollout's mean action
    reward. Rows carry `group_id` (the item), `rollout_id` and the rollout's task metrics:
    `accuracy` (r1), `tool_success` (mean r2), `compression` (r3), `content_quality`
    (mean r4), `mean_reward`.

    `answerer`: who answers the questions — `retrieval` (a reader that looks the question's
    words up in the memory, standing in for Mem-alpha's frozen QA model) or `policy` (the
    policy, prompted with the whole memory; those turns are not trained, as in Mem-alpha).
    """

    metric_keys = ("accuracy", "tool_success", "compression", "content_quality", "mean_reward")

    def __init__(self, gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, max_steps: int = 1,
                 beta: float = 0.05, gamma: float = 0.1, answerer: str = "retrieval",
                 **kwargs: Any) -> None:
        if answerer not in ANSWERERS:
            raise ValueError(f"MemoryAgentWorkflow answerer={answerer!r}; choose one of "
                             f"{list(ANSWERERS)}")
        super().__init__(ToolRegistry(), reward_fn=_unused_reward, gconfig=gconfig,
                         tokenizer=tokenizer, max_steps=max_steps, **kwargs)
        self.n_rollouts = gconfig.n_samples
        self.beta, self.gamma, self.answerer = beta, gamma, answerer

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        for key in ("chunks", "questions", "answers"):
            if key not in data:
                raise KeyError(f"MemoryAgentWorkflow: data item has no {key!r}; "
                               f"keys: {sorted(data)}")
        group_id = stable_id(data.get("id", data["chunks"][0]))
        rollouts = await asyncio.gather(*(self._rollout(engine, data, group_id, k)
                                          for k in range(self.n_rollouts)))
        return validate_trajectory(concat_padded([row for rows in rollouts for row in rows]))

    async def _rollout(self, engine: InferenceEngine, data: dict[str, Any], group_id: int,
                       k: int) -> list[TensorDict]:
        memory = MemoryStore()
        tools = memory.registry()
        scripted = list(data.get("scripted_actions", ()))
        reads: list[Conversation] = []
        for i, chunk in enumerate(data["chunks"]):
            script = (scripted.pop(0),) if scripted else ()
            reads.append(await self.run_conversation(
                engine, [chunk_message(i, chunk)], tools, script,
                rid=f"memory-{group_id}-{k}-{i}", system=MEMORY_SYSTEM))
        answers = [await self._answer(engine, memory, q) for q in data["questions"]]
        r1 = sum(a.lower() == gold.lower() for a, gold in zip(answers, data["answers"],
                                                              strict=True)) / len(answers)
        source_len = sum(len(c) for c in data["chunks"])
        r3 = max(0.0, 1.0 - len(memory.render()) / source_len) if memory.entries else 0.0

        per_turn = [[_action_scores(turn, chunk) for turn in conv.turns]
                    for chunk, conv in zip(data["chunks"], reads, strict=True)]
        flat = [s for turns in per_turn for s in turns]
        action_r = [[r1 + r2 + self.beta * r3 + self.gamma * r4 for r2, r4 in turns]
                    for turns in per_turn]
        all_r = [r for turns in action_r for r in turns]
        mean_r = sum(all_r) / len(all_r) if all_r else 0.0
        metrics = dict(accuracy=r1, compression=r3, mean_reward=mean_r,
                       tool_success=sum(s[0] for s in flat) / len(flat) if flat else 0.0,
                       content_quality=sum(s[1] for s in flat) / len(flat) if flat else 0.0)
        rows = []
        for conv, rewards in zip(reads, action_r, strict=True):
            dense = torch.zeros(len(conv.builder))
            for turn, r in zip(conv.turns, rewards, strict=True):
                dense[turn.end] += r
            rows.append(validate_trajectory(conv.builder.to_tensordict(
                mean_r, action_rewards=dense, num_actions=len(conv.turns), group_id=group_id,
                rollout_id=k, **metrics)))
        return rows

    async def _answer(self, engine: InferenceEngine, memory: MemoryStore, question: str) -> str:
        if self.answerer == "retrieval":
            return answer_from_memory([memory.entries[i] for i in sorted(memory.entries)],
                                      question)
        msg = {"role": "user", "content": f"Memory:\n{memory.render()}\nQuestion: {question}"
                                          f"\nAnswer:"}
        conv = await self.run_conversation(engine, [msg], ToolRegistry(), ())
        return extract_final_answer(conv.final_text)


def _action_scores(turn: Turn, chunk: str) -> tuple[float, float]:
    """(r2, r4) of one action: the share of its calls that succeeded, and that succeeded
    storing words of `chunk`; an action calling no tool scores (0, 0)."""
    if not turn.calls:
        return 0.0, 0.0
    ok = [result.ok for _, result in turn.calls]
    valid = [result.ok and content_validity(call, chunk) == 1.0 for call, result in turn.calls]
    return sum(ok) / len(ok), sum(valid) / len(valid)


def _unused_reward(prompt: str, completion: str, **_: Any) -> float:
    raise RuntimeError("MemoryAgentWorkflow computes its own reward")
