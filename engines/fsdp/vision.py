"""Vision-language models (Qwen2-VL family) in the FSDP2 engine.

- Loading: `AutoModelForImageTextToText`, the language model on the engine's packed attention,
  the vision tower on SDPA. The vision tower splits its patches per image itself and attends
  without a causal mask; the packed kwargs that mark the text's sequences reach it too (HF
  passes them down), and must not steer it.
- Every micro-batch runs the vision tower: one without images gets a dummy one, a 2 x 2-patch
  black image on a sequence of its own whose logits are dropped. FSDP2 all-gathers each
  vision block's weights in forward and reduce-scatters the gradients of those that have one
  in backward; a rank that skipped the tower would take part in neither, and the ranks'
  collectives would no longer match (measured: gloo "Received data size doesn't match" in
  the reduce-scatter). The dummy's gradients are exactly zero.
- Positions: M-RoPE gives image tokens (t, h, w) positions and text tokens one position on
  all three axes. They are computed per packed sequence with the model's own
  `get_rope_index` and passed as [4, 1, T]: row 0 the text positions (restarting at 0 per
  sequence), rows 1-3 the M-RoPE ones.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def require_vision_language(path: str, key: str) -> None:
    from transformers import AutoConfig

    if not is_vision_language(AutoConfig.from_pretrained(path)):
        raise ValueError(f"{key}=true but {path} is not a vision-language model")


def freeze_vision_tower(model: Any) -> int:
    """Stop gradients into the vision tower (patch embedding, blocks and merger); returns the
    number of frozen parameters. The language model and its head still train."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    if tower is None:
        raise ValueError(f"freeze_vision_tower: {type(model).__name__} has no `model.visual` "
                         f"module to freeze")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def attn_implementations(text: str) -> dict[str, str]:
    return {"": text, "text_config": text, "vision_config": "sdpa"}


def with_dummy_image(mb: TensorDict, config: Any) -> TensorDict:
    """`mb` plus one sequence of a single image token with a black 2 x 2-patch image (one
    token after the 2 x 2 merge), when `mb` has no image (see module doc); else `mb`."""
    if "image_grid_thw" in mb.keys() and mb["image_grid_thw"].shape[0] > 0:
        return mb
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    patch_dim = (int(vision.in_channels) * int(vision.temporal_patch_size)
                 * int(vision.patch_size) ** 2)
    device = mb["input_ids"].device
    cu = mb["cu_seqlens"]
    return TensorDict({
        "input_ids": torch.cat([mb["input_ids"], torch.tensor([int(config.image_token_id)],
                                                                device=device)]),
        "position_ids": torch.cat([mb["position_ids"], torch.zeros(1, dtype=torch.long,
                                                                    device=device)]),
        "cu_seqlens": torch.cat([cu, cu[-1:] + 1]),
        "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
        "pixel_values": torch.zeros(merge * merge, patch_dim, device=device),
    }, batch_size=[])


def vision_model_kwargs(model: Any, mb: TensorDict) -> dict[str, Any]:
    """`position_ids` (M-RoPE, [4, 1, T]) and the images of a packed micro-batch."""
    ids, text_positions = mb["input_ids"], mb["position_ids"]
    bounds = mb["cu_seqlens"].tolist()
    has_images = "image_grid_thw" in mb.keys() and mb["image_grid_thw"].shape[0] > 0
    grids = mb["image_grid_thw"] if has_images else torch.zeros(0, 3, dtype=torch.long)
    config = model.config
    merge = int(config.vision_config.spatial_merge_size) ** 2
    tokens_per_image = (grids.prod(-1) // merge).tolist()
    image_token = int(config.image_token_id)
    pieces, first_image = [], 0
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        seq = ids[start:end]
        is_image = seq == image_token
        n_tokens = int(is_image.sum())
        n_images, counted = 0, 0
        while counted < n_tokens and first_image + n_images < len(tokens_per_image):
            counted += tokens_per_image[first_image + n_images]
            n_images += 1
        if counted != n_tokens:
            raise ValueError(f"a packed sequence holds {n_tokens} image tokens but its images "
                             f"({grids[first_image:first_image + n_images].tolist()}) make "
                             f"{counted}: the ids and 'image_grid_thw' disagree")
        if n_images == 0:
            pieces.append(text_positions[start:end].expand(3, -1))
            continue
        rope, _ = model.model.get_rope_index(
            seq[None], mm_token_type_ids=is_image[None].int(),
            image_grid_thw=grids[first_image:first_image + n_images])
        pieces.append(rope[:, 0])
        first_image += n_images
    if first_image != len(tokens_per_image):
        raise ValueError(f"the micro-batch has {len(tokens_per_image)} images but its sequences "
                         f"hold image tokens for {first_image}")
    mrope = torch.cat(pieces, dim=1).to(ids.device)
    kwargs: dict[str, Any] = {"position_ids": torch.cat([text_positions[None], mrope])[:, None]}
    if has_images:
        kwargs["pixel_values"] = mb["pixel_values"]
        kwargs["image_grid_thw"] = grids
    return kwargs
