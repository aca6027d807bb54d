"""RLVR: sample `n_samples` completions per prompt and score them with a verifier."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
    validate_trajectory,
)
from areal_like.rewards.failures import GroupRewardFailure, RewardFailure, reward_results
from areal_like.rewards.reward_executor import RewardExecutor, UsesRewards
from areal_like.utils.batching import concat_padded
from areal_like.utils.chat import decode_text
from workflows.common import (
    TrajectoryBuilder,
    chat_prompt_ids,
    load_tokenizer,
    stable_id,
    with_eos_stop,
)


class RLVRWorkflow(RolloutWorkflow, UsesRewards):
    """One prompt in, one group of `gconfig.n_samples` scored trajectories out.

    `data` needs `messages` (chat) and whatever the reward function reads (e.g. `answer`);
    `data["id"]` becomes the group's `group_id`. Rows of the group stay together, in order.
    A sample whose reward fails is never given a reward: the episode raises
    `GroupRewardFailure` carrying the rows that did succeed, and the executor decides whether
    they may be trained on without their group.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer: PreTrainedTokenizerBase | str,
        reward_executor: Optional[RewardExecutor] = None,
        enable_thinking: Optional[bool] = None,
    ) -> None:
        self.reward_fn = reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        self.enable_thinking = enable_thinking  # None: as configured (model.chat_template_kwargs)
        self.gconfig = with_eos_stop(gconfig, self.tokenizer)
        self.use_rewards(reward_fn, reward_executor)  # else the episode's (see UsesRewards)

    def prompt_ids(self, data: dict[str, Any]) -> list[int]:
        if "messages" not in data:
            raise KeyError(f"RLVRWorkflow: data item has no 'messages'; keys: {sorted(data)}")
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return chat_prompt_ids(self.tokenizer, data["messages"], **extra)

    async def sample_group(self, engine: InferenceEngine, input_ids: list[int]
                           ) -> list[ModelResponse]:
        """`gconfig.n_samples` completions of one prompt, sampled concurrently (one request
        where the engine's servers take a batch)."""
        return await engine.agenerate_n(ModelRequest(input_ids=input_ids, gconfig=self.gconfig))

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        input_ids = self.prompt_ids(data)
        prompt = decode_text(self.tokenizer, input_ids)
        responses = await self.sample_group(engine, input_ids)
        rewards = await self.score(prompt, responses, data)
        return self.group_trajectory(input_ids, responses, rewards,
                                     stable_id(data.get("id", prompt)))

    async def score(self, prompt: str, responses: list[ModelResponse],
                    data: dict[str, Any]) -> list[float | RewardFailure]:
        """Rewards of the decoded completions, evaluated concurrently; a failed call is
        returned as its `RewardFailure` (anything else, e.g. a spent error budget, raises)."""
        texts = [decode_text(self.tokenizer, r.output_tokens, skip_special_tokens=True)
                 for r in responses]
        results = await asyncio.gather(*[
            self.reward_executor(self.reward_fn, prompt, t, **data,
                                 token_ids=(r.input_tokens, r.output_tokens))
            for t, r in zip(texts, responses, strict=True)
        ], return_exceptions=True)
        return reward_results(results)

    @classmethod
    def group_trajectory(cls, input_ids: list[int], responses: list[ModelResponse],
                         rewards: list[float | RewardFailure], group_id: int,
                         **per_sequence: list[Any]) -> TensorDict:
        """One validated group: a row per response (prompt + completion), in order. If any
        reward failed, raise `GroupRewardFailure` with the group of the other rows."""
        failures = [r for r in rewards if isinstance(r, RewardFailure)]
        if failures:
            keep = [i for i, r in enumerate(rewards) if not isinstance(r, RewardFailure)]
            survivors = None
            if keep:
                survivors = cls.group_trajectory(
                    input_ids, [responses[i] for i in keep], [rewards[i] for i in keep],
                    group_id, **{k: [v[i] for i in keep] for k, v in per_sequence.items()})
            raise GroupRewardFailure(failures, survivors)
        scores = [r for r in rewards if not isinstance(r, RewardFailure)]
        rows = []
        for i, (resp, reward) in enumerate(zip(responses, scores, strict=True)):
            builder = TrajectoryBuilder(input_ids)
            builder.add_generation(resp)
            extras = {k: v[i] for k, v in per_sequence.items()}
            rows.append(builder.to_tensordict(
                reward, group_id=group_id, truncated=int(resp.stop_reason == "length"), **extras
            ))
        return validate_trajectory(concat_padded(rows))
