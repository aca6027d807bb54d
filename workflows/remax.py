"""ReMax: the greedy completion's reward is the baseline of a sampled completion."""

from __future__ import annotations

import asyncio
from typing import Any

from tensordict import TensorDict

from areal_like.api import InferenceEngine, ModelRequest
from workflows.common import stable_id
from workflows.rlvr import RLVRWorkflow


class ReMaxWorkflow(RLVRWorkflow):
    """Per prompt: one greedy and `n_samples` sampled completions, generated concurrently.

    Each sampled trajectory's `rewards` is `r(sample) - r(greedy)` (every generated token gets
    this same advantage under a REINFORCE loss); `raw_rewards` and `greedy_rewards` keep both.
    The greedy completion is only a baseline and is not trained on.
    """

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        input_ids = self.prompt_ids(data)
        prompt = self.tokenizer.decode(input_ids)
        sampled_cfg = self.gconfig.new(n_samples=1)
        greedy_cfg = self.gconfig.new(n_samples=1, greedy=True)
        greedy, *samples = await asyncio.gather(
            engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=greedy_cfg)),
            *[engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=sampled_cfg))
              for _ in range(self.gconfig.n_samples)],
        )
        greedy_reward, *sample_rewards = await self.score(prompt, [greedy, *samples], data)
        return self.group_trajectory(
            input_ids, samples, [r - greedy_reward for r in sample_rewards],
            stable_id(data.get("id", prompt)), raw_rewards=sample_rewards,
            greedy_rewards=[greedy_reward] * len(samples),
        )
