"""RLVR on prompts with images (vision-language models, docs/vision.md)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Optional

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, ModelRequest, ModelResponse
from areal_like.models.vision import VisionProcessor, VisionPrompt, image_tensors
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.utils.chat import decode_text
from workflows.common import stable_id
from workflows.rlvr import RLVRWorkflow


class VisionRLVRWorkflow(RLVRWorkflow):
    """RLVR where `data["messages"]` has image parts (`{"type": "image"}`) standing for
    `data["images"]` (PIL images, paths or encoded bytes), in order.

    The server gets the images and prompt ids with one image pad per image; the trajectory
    holds the prompt as the model reads it (pads expanded) and the images as `pixel_values`
    / `image_grid_thw` rows (`areal_like.models.vision`). `tokenizer` may be a path or a
    tokenizer loaded from the model folder: the image processor is read from that folder.

    A completion ends at a vision token (`<|image_pad|>`, `<|vision_start|>`, ...: stop
    tokens here), which is then left out and the sample counted as truncated: the model
    reads such a token as a place for image features, so a trainer could not score the
    sequence (measured: a tiny model sampled `<|image_pad|>` within 150 steps of GRPO).
    """

    needs_images = True

    def __init__(self, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str,
                 reward_executor: Optional[RewardExecutor] = None) -> None:
        self.processor = vision_processor(tokenizer)
        super().__init__(reward_fn, with_vision_stops(gconfig, self.processor),
                         self.processor.tokenizer, reward_executor)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        prompt = item_prompt(self.processor, data, type(self).__name__)
        responses = await sample_with_images(engine, prompt, self.gconfig, self.processor)
        text = decode_text(self.tokenizer, prompt.input_ids)
        rewards = await self.score(text, responses,
                                   {k: v for k, v in data.items() if k != "images"})
        images = image_tensors(prompt)
        return self.group_trajectory(
            prompt.expanded_ids, responses, rewards, stable_id(data.get("id", text)),
            **{key: [value] * len(responses) for key, value in images.items()})


def vision_processor(tokenizer: PreTrainedTokenizerBase | str) -> VisionProcessor:
    """The processor of the model folder `tokenizer` is (or was loaded from)."""
    return VisionProcessor(tokenizer if isinstance(tokenizer, str) else tokenizer.name_or_path)


def with_vision_stops(gconfig: GenerationHyperparameters,
                      processor: VisionProcessor) -> GenerationHyperparameters:
    """`gconfig` with the vision tokens as stop tokens (see VisionRLVRWorkflow)."""
    stops = [t for t in processor.vision_token_ids if t not in gconfig.stop_token_ids]
    return gconfig.new(stop_token_ids=[*gconfig.stop_token_ids, *stops])


def item_prompt(processor: VisionProcessor, data: dict[str, Any], workflow: str) -> VisionPrompt:
    if "images" not in data:
        raise KeyError(f"{workflow}: data item has no 'images'; keys: {sorted(data)}")
    return processor.prompt(data["messages"], data["images"])


async def sample_with_images(engine: InferenceEngine, prompt: VisionPrompt,
                             gconfig: GenerationHyperparameters,
                             processor: VisionProcessor) -> list[ModelResponse]:
    """`gconfig.n_samples` completions of `prompt` with its images, each checked against the
    trainer's token count and cut before a vision token."""
    single = gconfig.new(n_samples=1)
    responses = list(await asyncio.gather(*[
        engine.agenerate(ModelRequest(input_ids=prompt.input_ids, image_data=prompt.image_data,
                                      gconfig=single))
        for _ in range(gconfig.n_samples)]))
    for response in responses:
        _check_server_counted(prompt, response)
    return [without_vision_tail(r, processor.vision_token_ids) for r in responses]


def _check_server_counted(prompt: VisionPrompt, response: ModelResponse) -> None:
    """The server expanded the images into as many tokens as the trainer will see: otherwise
    its log-probs belong to other positions (e.g. a server started with another pixel
    budget)."""
    counted = response.metadata.get("prompt_tokens")
    if counted is None or response.metadata.get("segments", 1) != 1:
        return  # a continued request counts its earlier output in its prompt
    if counted != len(prompt.expanded_ids):
        raise ValueError(f"server {response.metadata.get('server')} read the prompt as "
                         f"{counted} tokens with its images, the trainer as "
                         f"{len(prompt.expanded_ids)} (image grids "
                         f"{prompt.image_grid_thw.tolist()}): the two resize images differently")


def without_vision_tail(response: ModelResponse, vision_token_ids: tuple[int, ...]
                        ) -> ModelResponse:
    """`response` without a last token that is a vision token, then marked truncated."""
    if not response.output_tokens or response.output_tokens[-1] not in vision_token_ids:
        return response
    return dataclasses.replace(response, output_tokens=response.output_tokens[:-1],
                               output_logprobs=response.output_logprobs[:-1],
                               output_versions=response.output_versions[:-1],
                               stop_reason="length")
