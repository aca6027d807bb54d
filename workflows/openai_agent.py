"""A workflow around an agent written for the OpenAI client: `agent(client, data)` runs one
episode with `client.chat.completions.create` and returns its reward (or sets rewards itself).

    async def agent(client, data):          # client: openai.AsyncOpenAI or ArealOpenAI
        completion = await client.chat.completions.create(model="policy", messages=[...])
        return 1.0 if completion.choices[0].message.content == data["answer"] else 0.0

    workflow = OpenAIAgentWorkflow(agent, gconfig, tokenizer, turn_discount=0.9)
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.utils.batching import concat_padded
from workflows.common import load_tokenizer, stable_id
from workflows.openai_client import ArealOpenAI

Agent = Callable[[ArealOpenAI, dict[str, Any]], Awaitable[Optional[float]]]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """`gconfig.n_samples` episodes of `agent` per data item, concurrently, one client each;
    a group of rows with one `group_id` (GRPO-ready).

    The agent's return value, when not None, is the episode's final reward; it is spread over
    the calls by `turn_discount` (returns-to-go). `export_style` "concat" trains one row per
    conversation, "individual" one row per call. An agent that raises fails the episode (the
    executor counts it), never a reward of 0.
    """

    def __init__(self, agent: Agent, gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, turn_discount: float = 1.0,
                 export_style: str = "concat") -> None:
        if export_style not in ("concat", "individual"):
            raise ValueError(f"export_style={export_style!r}: expected 'concat' or "
                             f"'individual'")
        self.agent = agent
        self.gconfig = gconfig
        self.tokenizer = load_tokenizer(tokenizer)
        self.turn_discount = turn_discount
        self.export_style = export_style

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any],
                       group_id: int) -> TensorDict:
        client = ArealOpenAI(engine, self.tokenizer, self.gconfig.new(n_samples=1))
        reward = await self.agent(client, data)
        if reward is not None:
            client.set_final_reward(float(reward))
        client.apply_reward_discount(self.turn_discount)
        return client.export_batch(self.export_style, group_id=group_id)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        group_id = stable_id(data.get("id", repr(data.get("messages"))))
        rows = await asyncio.gather(*[self._episode(engine, data, group_id)
                                      for _ in range(self.gconfig.n_samples)])
        return concat_padded(list(rows))
