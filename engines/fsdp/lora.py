"""LoRA on the FSDP2 engine: PEFT adapters on a frozen base, and the adapter as the fleet
loads it (a PEFT folder, or its tensors + config in memory)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from safetensors.torch import save_file
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from areal_like.api.io_struct import AdapterWeights
from areal_like.api.lora_config import LoRAConfig

if TYPE_CHECKING:  # peft is imported where an adapter is made (0.5 s every trainer start else)
    from peft import LoraConfig, PeftModel

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def linear_layer_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer of `model` (what LoRA's target_modules name)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def apply_lora(model: torch.nn.Module, lora: LoRAConfig, model_path: str) -> PeftModel:
    """`model` wrapped by PEFT: the base frozen, adapters (B = 0: the same outputs as the base
    at first) on `lora.target_modules`, which must all exist in the model."""
    names = linear_layer_names(model)
    missing = sorted(set(lora.target_modules) - names)
    if missing:
        raise ValueError(f"actor.lora.target_modules names {missing}, which the model at "
                         f"{model_path!r} does not have as linear layers (it has: "
                         f"{sorted(names)})")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none",
                        base_model_name_or_path=model_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # every rank draws the same A matrices
        return get_peft_model(model, config)


def adapter_config_dict(model: PeftModel) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, as a JSON-ready dict."""
    raw = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, set)
                                 else str(v)))


def gather_adapter(model: PeftModel, rank: int) -> Optional[AdapterWeights]:
    """Collective over the trainer ranks: the full adapter (PEFT's saved names, no adapter
    name inside) on CPU at rank 0; None elsewhere."""
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        tensor = param.detach()
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective
        if rank == 0:
            full[name] = tensor.to("cpu", copy=True)
    if rank != 0:
        return None
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=full)
    return AdapterWeights(config=adapter_config_dict(model),
                          tensors={k: v.contiguous() for k, v in state.items()})


def write_adapter_folder(adapter: AdapterWeights, path: str) -> None:
    """A PEFT adapter folder (what `PeftModel.from_pretrained` and the servers load)."""
    os.makedirs(path, exist_ok=True)
    save_file(adapter.tensors, os.path.join(path, ADAPTER_WEIGHTS_FILE),
              metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(adapter.config, f, indent=2, sort_keys=True)


def merged_state_dict(model: PeftModel, full_state: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Rank 0: the HF weights of base + adapter (W + alpha/r * B @ A), from the engine's
    gathered full state dict, under the base model's own names."""
    lora_cfg = cast("LoraConfig", model.peft_config["default"])
    scaling = lora_cfg.lora_alpha / lora_cfg.r
    prefix = "base_model.model."
    merged: dict[str, torch.Tensor] = {}
    for key, value in full_state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix(prefix).replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):  # (a bias stays as it is)
            stem = key.removesuffix(".base_layer.weight")
            a = full_state[f"{stem}.lora_A.default.weight"].double()
            b = full_state[f"{stem}.lora_B.default.weight"].double()
            value = (value.double() + scaling * (b @ a)).to(value.dtype)
        merged[name] = value
    return merged


class FrozenBaseView:
    """`forward` of an engine's model with its LoRA adapters switched off (see
    `FSDPEngine.base_model_view`); shares the engine's weights, trains nothing."""

    def __init__(self, engine: Any) -> None:  # an FSDPEngine with LoRA adapters
        self.engine = engine

    def eval(self) -> FrozenBaseView:
        self.engine.eval()
        return self

    def train(self, mode: bool = True) -> FrozenBaseView:
        self.engine.train(mode)
        return self

    def forward(self, batch: TensorDict,
                post_hook: Optional[Callable[[torch.Tensor, TensorDict], torch.Tensor]] = None,
                aggregate_fn: Optional[Callable[[list[torch.Tensor]], Any]] = None) -> Any:
        with self.engine.model.disable_adapter():
            return self.engine.forward(batch, post_hook=post_hook, aggregate_fn=aggregate_fn)
