"""ReMax: the greedy completion's reward is the baseline of a sampled completion."""

from __future__ import annotations

import asyncio
from typing import Any

from tensordict import TensorDict

from areal_like.api import InferenceEngine, ModelRequest
from areal_like.rewards.failures import GroupRewardFailure, RewardFailure
from areal_like.utils.chat import decode_text
from workflows.common import stable_id
from workflows.rlvr import RLVRWorkflow


class ReMaxWorkflow(RLVRWorkflow):
    """Per prompt: one greedy and `n_samples` sampled completions, generated concurrently.

    Each sampled trajectory's `rewards` is r(sample) and its `baseline_rewards` r(greedy); the
    `remax` estimator shapes both alike and trains on the difference. The greedy completion
    is only a baseline and is not trained on. If the greedy reward fails the whole group is
    excluded (no baseline); a failed sample alone excludes only itself.
    """

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        input_ids = self.prompt_ids(data)
        prompt = decode_text(self.tokenizer, input_ids)
        sampled_cfg = self.gconfig.new(n_samples=1)
        greedy_cfg = self.gconfig.new(n_samples=1, greedy=True)
        greedy, *samples = await asyncio.gather(
            engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=greedy_cfg)),
            *[engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=sampled_cfg))
              for _ in range(self.gconfig.n_samples)],
        )
        greedy_reward, *sample_rewards = await self.score(prompt, [greedy, *samples], data)
        if isinstance(greedy_reward, RewardFailure):
            failures = [r for r in sample_rewards if isinstance(r, RewardFailure)]
            raise GroupRewardFailure([greedy_reward, *failures], survivors=None)
        return self.group_trajectory(
            input_ids, samples, sample_rewards, stable_id(data.get("id", prompt)),
            baseline_rewards=[greedy_reward] * len(samples),
        )
