"""The ReMax workflow of AReaL-lite's "Training Algorithm" document (Step 1), ported: only the
imports differ, and the lines marked `# areal-like:` where our contract differs (see
docs/migrating_from_arealite.md)."""

import asyncio
import uuid

import torch
from tensordict import TensorDict

from areal_like.arealite import InferenceEngine, LLMRequest, RLVRWorkflow


class ReMaxRLVRWorkflow(RLVRWorkflow):  # areal-like: the document's base, RolloutWorkflow, has no __init__ for the reward_fn/gconfig/tokenizer it is built with; RLVRWorkflow's sets them
    async def arun_episode(self, engine: InferenceEngine, data):
        # Prepare input tokens from chat messages
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"],
            tokenize=True,
            add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
        )
        n_samples = self.gconfig.n_samples  # noqa: F841 (unused in the document too)
        rid = uuid.uuid4().hex
        # Create requests for both sampled and greedy generation
        sample_req = LLMRequest(
            rid=rid,
            input_ids=input_ids,
            gconfig=self.gconfig,
        )
        greedy_req = LLMRequest(
            rid=rid,
            input_ids=input_ids,
            gconfig=self.gconfig.new(greedy=True),
        )
        # Generate both responses concurrently
        resp, greedy_resp = await asyncio.gather(
            engine.agenerate(sample_req),
            engine.agenerate(greedy_req),
        )
        # Calculate rewards for both completions
        prompt_str = self.tokenizer.decode(input_ids)
        completions_str = self.tokenizer.decode(resp.output_tokens)
        sample_reward = self.reward_fn(
            prompt=prompt_str,
            completions=completions_str,
            prompt_ids=resp.input_tokens,
            completion_ids=resp.output_tokens,
            **data,
        )
        greedy_completions = self.tokenizer.decode(greedy_resp.output_tokens)
        greedy_reward = self.reward_fn(
            prompt=prompt_str,
            completions=greedy_completions,
            prompt_ids=greedy_resp.input_tokens,
            completion_ids=greedy_resp.output_tokens,
            **data,
        )
        # Package results for training
        res = dict(
            # Add batch dimension
            input_ids=torch.tensor(resp.input_tokens + resp.output_tokens).unsqueeze(0),
            loss_mask=torch.tensor([0] * resp.input_len + [1] * resp.output_len).unsqueeze(0),
            versions=torch.tensor([-1] * resp.input_len + resp.output_versions).unsqueeze(0),
            attention_mask=torch.ones(resp.input_len + resp.output_len, dtype=torch.bool).unsqueeze(0),
            # Use reward difference across all tokens
            rewards=torch.tensor([float(sample_reward - greedy_reward)] * (resp.input_len + resp.output_len)).unsqueeze(0),  # areal-like: .unsqueeze(0), the batch dimension TensorDict(batch_size=[1]) requires
        )
        return TensorDict(res, batch_size=[1])
