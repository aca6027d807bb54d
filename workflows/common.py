"""Pieces every workflow uses: token accounting, chat prompts, stable group ids."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
from tensordict import TensorDict
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, ModelResponse
from areal_like.api.trajectory import NO_EXPERT, ROUTED_EXPERTS
from areal_like.utils.chat import render_chat


def load_tokenizer(tokenizer: PreTrainedTokenizerBase | str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer


def stable_id(value: Any) -> int:
    """A non-negative int64 derived from `value` (same in every process, unlike hash())."""
    digest = hashlib.blake2b(str(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **template_kwargs: Any
) -> list[int]:
    """Token ids of `messages` rendered with the chat template plus the assistant header
    (template kwargs: the configured ones, see `areal_like.utils.chat`, then these)."""
    text = render_chat(tokenizer, messages, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def with_eos_stop(gconfig: GenerationHyperparameters,
                  tokenizer: PreTrainedTokenizerBase) -> GenerationHyperparameters:
    """`gconfig` that also stops on the tokenizer's EOS id (generation is token-in/token-out)."""
    eos = tokenizer.eos_token_id
    if eos is None or eos in gconfig.stop_token_ids:
        return gconfig
    return gconfig.new(stop_token_ids=[*gconfig.stop_token_ids, eos])


class TrajectoryBuilder:
    """Accumulates one sequence exactly as sent and generated, never re-tokenizing.

    Context tokens (prompts, feedback, tool results) get `loss_mask` 0 and version -1;
    generated tokens keep the server's log-probs and per-token versions.
    """

    def __init__(self, context_ids: Optional[list[int]] = None) -> None:
        self.input_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # a mixture of experts' routing (rollout.return_routed_experts): per position
        self.routed_experts: Optional[torch.Tensor] = None
        if context_ids:
            self.add_context(context_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_context(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generation(self, resp: ModelResponse) -> None:
        if resp.routed_experts is not None:  # the server's routing of the whole sequence
            if list(resp.input_tokens) != self.input_ids:
                raise ValueError(
                    f"rid={resp.rid}: routed experts came with a prompt of {resp.input_len} "
                    f"tokens that is not this trajectory's {len(self)} tokens so far; router "
                    f"replay needs the sequence sent exactly as trained")
            self.routed_experts = resp.routed_experts
        self.input_ids += resp.output_tokens
        self.loss_mask += [1] * resp.output_len
        self.logprobs += resp.output_logprobs
        self.versions += resp.output_versions

    def to_tensordict(
        self, reward: float, **per_sequence: float | int | torch.Tensor
    ) -> TensorDict:
        """A [1, L] trajectory; `per_sequence` values become [1] tensors ([1, L] if given so)."""
        n = len(self.input_ids)
        data: dict[str, torch.Tensor] = {
            "input_ids": torch.tensor([self.input_ids], dtype=torch.long),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "loss_mask": torch.tensor([self.loss_mask], dtype=torch.bool),
            "logprobs": torch.tensor([self.logprobs], dtype=torch.float32),
            "versions": torch.tensor([self.versions], dtype=torch.long),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }
        if self.routed_experts is not None:  # context after the last generation: none
            routed = self.routed_experts
            missing = routed.new_full((n - routed.shape[0], routed.shape[1]), NO_EXPERT)
            data[ROUTED_EXPERTS] = torch.cat([routed, missing])[None]
        for key, value in per_sequence.items():
            if isinstance(value, torch.Tensor):
                data[key] = value.reshape(1, *value.shape) if value.dim() == 1 else value
            elif isinstance(value, int) and not isinstance(value, bool):
                data[key] = torch.tensor([value], dtype=torch.long)
            else:
                data[key] = torch.tensor([float(value)], dtype=torch.float32)
        return TensorDict(data, batch_size=[1])
