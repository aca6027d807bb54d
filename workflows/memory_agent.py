"""A memory-building agent: read a conversation chunk by chunk, keep a memory with tool calls,
then answer questions from that memory alone.

Reward = QA accuracy + tool-call success rate + beta * compression, plus gamma * content
validity on each memory-writing action (is what it stored actually in the chunk it read?).
`areal_like.data.memory_episodes` generates episodes procedurally (facts among chit-chat).
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, validate_trajectory
from areal_like.data.memory_episodes import make_memory_episodes  # noqa: F401 (re-export)
from areal_like.rewards.exact_match import extract_final_answer
from areal_like.utils.batching import concat_padded
from workflows.common import stable_id
from workflows.tool_agent import ToolAgentWorkflow
from workflows.tools import ToolCall, ToolRegistry, ToolResult


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


class MemoryAgentWorkflow(ToolAgentWorkflow):
    """Data items: `chunks` (list of str), `questions` and `answers` (lists of str).

    Returns one row per conversation (each chunk, then each question), all sharing the
    episode reward and group id; per-action rewards sit on action tokens. Every row carries
    the episode's task metrics: `accuracy` (QA accuracy: answers correct), `tool_success`
    (tool calls that succeeded), `compression` (1 - memory / source length) and
    `content_quality` (memory writes that store words of the chunk being read).
    """

    metric_keys = ("accuracy", "tool_success", "compression", "content_quality")

    def __init__(self, gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, max_steps: int = 3,
                 beta: float = 0.2, gamma: float = 0.1, **kwargs: Any) -> None:
        super().__init__(ToolRegistry(), reward_fn=_unused_reward, gconfig=gconfig,
                         tokenizer=tokenizer, max_steps=max_steps, **kwargs)
        self.beta, self.gamma = beta, gamma

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        for key in ("chunks", "questions", "answers"):
            if key not in data:
                raise KeyError(f"MemoryAgentWorkflow: data item has no {key!r}; "
                               f"keys: {sorted(data)}")
        memory, group_id = MemoryStore(), stable_id(data.get("id", data["chunks"][0]))
        tools = memory.registry()
        scripted = list(data.get("scripted_actions", ()))
        reads = []
        for i, chunk in enumerate(data["chunks"]):
            msg = {"role": "user", "content": f"Chunk {i + 1}:\n{chunk}\nUpdate your memory."}
            script = (scripted.pop(0),) if scripted else ()
            reads.append(await self.run_conversation(engine, [msg], tools, script))
        answers = []
        for question in data["questions"]:
            msg = {"role": "user",
                   "content": f"Memory:\n{memory.render()}\nQuestion: {question}\nAnswer:"}
            answers.append(await self.run_conversation(engine, [msg], ToolRegistry(), ()))

        qa = sum(extract_final_answer(c.final_text).lower() == a.lower()
                 for c, a in zip(answers, data["answers"], strict=True)) / len(answers)
        actions = [a for conv in reads for a in conv.actions]
        tool_ok = sum(r.ok for _, r, _ in actions) / len(actions) if actions else 0.0
        source_len = sum(len(c) for c in data["chunks"])
        compression = max(0.0, 1.0 - len(memory.render()) / source_len) if memory.entries else 0.0
        outcome = qa + tool_ok + self.beta * compression

        validity = [{id(call): content_validity(call, chunk) for call, _, _ in conv.actions}
                    for chunk, conv in zip(data["chunks"], reads, strict=True)]
        quality = [v for per_chunk in validity for v in per_chunk.values()]
        metrics = dict(accuracy=qa, tool_success=tool_ok, compression=compression,
                       content_quality=sum(quality) / len(quality) if quality else 0.0)
        rows = []
        for conv, per_chunk in zip(reads, validity, strict=True):
            rows.append(self.to_trajectory(conv, outcome, data, _validity_reward(per_chunk),
                                           self.gamma, group_id=group_id, **metrics))
        for conv in answers:
            rows.append(self.to_trajectory(conv, outcome, data, group_id=group_id, **metrics))
        return validate_trajectory(concat_padded(rows))


def _unused_reward(prompt: str, completion: str, **_: Any) -> float:
    raise RuntimeError("MemoryAgentWorkflow computes its own reward")


def _validity_reward(validity: dict[int, float]):  # noqa: ANN202
    def reward(call: ToolCall, result: ToolResult, data: dict[str, Any]) -> float:
        return validity.get(id(call), 0.0) if result.ok else 0.0

    return reward
