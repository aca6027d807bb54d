"""Process rewards on prompts with images: `PRMWorkflow` where the policy and the PRM both
see the item's pictures (seed 001's system, docs/vision.md)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine
from areal_like.models.vision import image_tensors
from areal_like.rewards.failures import reward_results
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.utils.chat import decode_text
from workflows.common import stable_id
from workflows.prm import PRMWorkflow
from workflows.vision_rlvr import (
    VisionRLVRWorkflow,
    item_prompt,
    sample_with_images,
    vision_processor,
    with_vision_stops,
)


class VisionPRMWorkflow(PRMWorkflow):
    """One item (`messages` with image parts, `images`) in, `gconfig.n_samples` rows out,
    each with the PRM's step scores on its steps' last tokens and the item's images as
    `pixel_values` / `image_grid_thw` (as `VisionRLVRWorkflow` carries them). The PRM gets
    the prompt text (one image pad per image), the steps and the images."""

    evaluation_class = VisionRLVRWorkflow
    needs_images = True

    def __init__(self, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, prm: Optional[PRMClient],
                 step_delimiter: str = "\n", empty_reward: float = 0.0,
                 average_steps: bool = False, outcome_coef: float = 0.0,
                 score_offset: float = 0.0,
                 reward_executor: Optional[RewardExecutor] = None) -> None:
        self.processor = vision_processor(tokenizer)
        super().__init__(reward_fn, with_vision_stops(gconfig, self.processor),
                         self.processor.tokenizer, prm, step_delimiter, empty_reward,
                         average_steps, outcome_coef, score_offset, reward_executor)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        prompt = item_prompt(self.processor, data, type(self).__name__)
        responses = await sample_with_images(engine, prompt, self.gconfig, self.processor)
        text = decode_text(self.tokenizer, prompt.input_ids)
        dense = reward_results(await asyncio.gather(
            *[self.step_rewards(text, r, prompt.image_data) for r in responses],
            return_exceptions=True))
        if self.outcome_coef:
            item = {k: v for k, v in data.items() if k != "images"}
            outcomes = await self.score(text, responses, item)  # the task verifier
            dense = [self.add_outcome(d, o) for d, o in zip(dense, outcomes, strict=True)]
        return self.rows(prompt.expanded_ids, responses, dense,
                         stable_id(data.get("id", text)), image_tensors(prompt))
