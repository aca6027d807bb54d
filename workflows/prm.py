"""Process rewards: sample completions, cut them into reasoning steps, let a PRM score each
step, and put each score on the step's last token (dense `rewards` [1, L] per row).

Steps and token positions come from `areal_like.rewards.prm_steps` (the completion's own
token ids, never re-tokenized); the PRM is reached over HTTP by `PRMClient`, whose failures
follow the reward rules: the sample is excluded and counted, never scored 0.0, and past the
error budget the run stops naming the URL. A completion with no text (it stopped at once)
has no step: its one reward, `empty_reward`, sits on its last token.

Against step spam (a policy that cuts its text into many short "steps" the PRM likes: seen
on the addition task with summed scores): `score_offset` b makes each step reward p_k - b,
so a step the PRM doubts costs reward; `average_steps` divides each score by the number of
steps K (the total is the mean step score, whatever K; but an earlier step's reward then
depends on later actions, which returns-to-go do not charge them for); `outcome_coef` > 0
adds outcome_coef x the task verifier's reward on the completion's last token.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelResponse,
    validate_trajectory,
)
from areal_like.rewards.failures import GroupRewardFailure, RewardFailure, reward_results
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.prm_steps import place_step_rewards, step_end_tokens
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.utils.batching import concat_padded
from areal_like.utils.chat import decode_text
from workflows.common import TrajectoryBuilder, stable_id
from workflows.rlvr import RLVRWorkflow


class PRMWorkflow(RLVRWorkflow):
    """One prompt in, `gconfig.n_samples` rows with PRM step rewards out.

    `reward_fn` is not used for training rewards (the PRM gives them); it stays the task's
    verifier, which held-out evaluation uses. `prm` may be None only where no episode runs
    (trainer ranks other than 0)."""

    evaluation_class: type[RLVRWorkflow] = RLVRWorkflow  # held-out runs need no PRM

    def __init__(self, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, prm: Optional[PRMClient],
                 step_delimiter: str = "\n", empty_reward: float = 0.0,
                 average_steps: bool = False, outcome_coef: float = 0.0,
                 score_offset: float = 0.0,
                 reward_executor: Optional[RewardExecutor] = None) -> None:
        super().__init__(reward_fn, gconfig, tokenizer, reward_executor)
        if not step_delimiter:
            raise ValueError("prm.step_delimiter is empty; set the text between steps")
        self.prm, self.step_delimiter, self.empty_reward = prm, step_delimiter, empty_reward
        self.average_steps, self.outcome_coef = average_steps, outcome_coef
        self.score_offset = score_offset

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        input_ids = self.prompt_ids(data)
        prompt = decode_text(self.tokenizer, input_ids)
        responses = await self.sample_group(engine, input_ids)
        # a spent budget or a bug stops the run; a RewardFailure excludes its sample
        dense = reward_results(await asyncio.gather(
            *[self.step_rewards(prompt, r) for r in responses], return_exceptions=True))
        if self.outcome_coef:
            outcomes = await self.score(prompt, responses, data)  # the task verifier
            dense = [self.add_outcome(d, o) for d, o in zip(dense, outcomes, strict=True)]
        return self.rows(input_ids, responses, dense, stable_id(data.get("id", prompt)))

    def add_outcome(self, dense: tuple[list[float], int] | RewardFailure,
                    outcome: float | RewardFailure) -> tuple[list[float], int] | RewardFailure:
        """outcome_coef x outcome added on the last completion token (either failure wins)."""
        if isinstance(dense, RewardFailure):
            return dense
        if isinstance(outcome, RewardFailure):
            return outcome
        rewards, n_steps = dense
        if not rewards:  # no completion token to carry it
            return dense
        return rewards[:-1] + [rewards[-1] + self.outcome_coef * outcome], n_steps

    async def step_rewards(self, prompt: str, resp: ModelResponse,
                           images: Optional[list[str]] = None) -> tuple[list[float], int]:
        """(per-completion-token rewards: each step's PRM score on its last token, steps);
        `images` (base64) go to a PRM that sees them."""
        if resp.output_len == 0:  # e.g. a VLM's only token, a vision token, was cut off
            return [], 0
        steps, positions = step_end_tokens(self.tokenizer, resp.output_tokens,
                                           self.step_delimiter)
        if not steps:
            return place_step_rewards(resp.output_len, [resp.output_len - 1],
                                      [self.empty_reward]), 0
        if self.prm is None:
            raise RuntimeError("PRMWorkflow was built without a PRMClient (prm=None); pass "
                               "one where episodes run")
        scores = [x - self.score_offset for x in await self.prm.score(prompt, steps, images)]
        if self.average_steps:
            scores = [x / len(steps) for x in scores]
        return place_step_rewards(resp.output_len, positions, scores), len(steps)

    def rows(self, input_ids: list[int], responses: list[ModelResponse],
             dense: list[tuple[list[float], int] | RewardFailure], group_id: int,
             extras: Optional[dict[str, torch.Tensor]] = None) -> TensorDict:
        """The validated group (`extras`: [1, ...] tensors every row carries, e.g. images);
        with failed rows, GroupRewardFailure carrying the others."""
        failures = [d for d in dense if isinstance(d, RewardFailure)]
        keep = [i for i, d in enumerate(dense) if not isinstance(d, RewardFailure)]
        rows = []
        for i in keep:
            builder = TrajectoryBuilder(input_ids)
            builder.add_generation(responses[i])
            kept = dense[i]
            assert not isinstance(kept, RewardFailure)
            token_rewards, n_steps = kept
            td = builder.to_tensordict(0.0, group_id=group_id, n_steps=n_steps,
                                       truncated=int(responses[i].stop_reason == "length"),
                                       **(extras or {}))
            td["rewards"] = torch.tensor([[0.0] * len(input_ids) + token_rewards],
                                         dtype=torch.float32)
            rows.append(td)
        group = validate_trajectory(concat_padded(rows)) if rows else None
        if failures:
            raise GroupRewardFailure(failures, group)
        assert group is not None
        return group
