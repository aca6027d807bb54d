"""One packed micro-batch through the engine's model, on the path the engine was set up for:
packed whole (sequences cut at `cu_seqlens`), as a prefix tree (each shared prefix once), with
a vision-language model's images, or split over a Ulysses group's ranks. Every path returns the
micro-batch's per-token outputs [T, V] (a critic: [T])."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.api.trajectory import ROUTED_EXPERTS
from engines.fsdp.attention import packed_model_kwargs
from engines.fsdp.moe import RouterControl
from engines.fsdp.shared_prefix import PrefixTreeUse
from engines.fsdp.ulysses import gather_outputs, shard_inputs
from engines.fsdp.vision import vision_model_kwargs, with_dummy_image


class PackedForward:
    """The model's outputs for packed micro-batches (see the module docstring)."""

    def __init__(self, model: Any, device: torch.device, *, is_critic: bool, pad_token_id: int,
                 vision_language: bool, routers: Optional[RouterControl], router_replay: bool,
                 trees: Optional[PrefixTreeUse], sequence_group: Optional[dist.ProcessGroup],
                 inner_attn: str) -> None:
        self.model, self.device = model, device
        self.is_critic, self.pad_token_id = is_critic, pad_token_id
        self.vision_language = vision_language
        self.routers, self.router_replay = routers, router_replay
        self.trees = trees
        self.sequence_group, self.inner_attn = sequence_group, inner_attn

    def dummy(self) -> TensorDict:
        """A one-token micro-batch for a rank with fewer rows than micro-batches (FSDP needs
        the same collectives everywhere); its outputs train nothing."""
        ids = torch.tensor([self.pad_token_id], device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        mb = TensorDict({"input_ids": ids, "position_ids": zero,
                         "cu_seqlens": torch.tensor([0, 1], device=self.device)}, batch_size=[])
        if self.routers is not None:  # routed by the trainer's own top-k
            mb[ROUTED_EXPERTS] = self.routers.unrouted(1, self.device)
        return mb

    def logits(self, mb: TensorDict) -> torch.Tensor:
        if self.sequence_group is not None:  # this rank's chunk of tokens, gathered back
            shard, ids, inputs = shard_inputs(mb, self.sequence_group, self.inner_attn,
                                              self.pad_token_id)
            out = self.model(input_ids=ids, attention_mask=None, use_cache=False, **inputs)
            return self._per_token(gather_outputs(out.logits[0], shard))
        n_tokens = mb["input_ids"].shape[0]
        tree, ids = self.trees.plan(mb) if self.trees is not None else None, mb["input_ids"]
        if self.vision_language:  # the vision tower runs on every rank (engines/fsdp/vision.py)
            mb = with_dummy_image(mb, self.model.config)  # (its tokens after the batch's)
            ids, inputs = mb["input_ids"], {**vision_model_kwargs(self.model, mb),
                                            **packed_model_kwargs(mb["cu_seqlens"])}
        elif tree is not None:  # each shared prefix once; outputs gathered back per token
            ids, inputs = tree.input_ids, {"position_ids": tree.position_ids[None],
                                           "tree_buckets": tree.attention}
        else:
            inputs = {"position_ids": mb["position_ids"][None],
                      **packed_model_kwargs(mb["cu_seqlens"])}
        if self.routers is not None:
            self.routers.begin(mb, self.router_replay)
        out = self.model(input_ids=ids[None], attention_mask=None, use_cache=False, **inputs)
        return self._per_token(out.logits[0].index_select(0, tree.unshared) if tree is not None
                               else out.logits[0, :n_tokens])

    def _per_token(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.squeeze(-1) if self.is_critic else logits
