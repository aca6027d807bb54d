"""Model loading, HF-format export and exact-resume (DCP) checkpoints for the FSDP2 engine."""

from __future__ import annotations

import collections
import os
import random
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from areal_like.api.io_struct import ParamSpec
from areal_like.models.qwen2_vl_config import write_flat_config
from engines.fsdp.dist import all_reduce_scalar
from engines.fsdp.vision import attn_implementations, is_vision_language

# Files copied next to exported weights so that the folder is a complete HF model folder.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)
# A vision-language model's image processor, copied from the source folder into every export:
# the folder then serves images too.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_hf_model(path: str, is_critic: bool, dtype: torch.dtype,
                  attn_implementation: str) -> PreTrainedModel:
    """An HF causal LM or VLM, or (critic) the same backbone with a 1-output head (a
    token-classification head; on a VLM, in place of the LM head).

    The critic head of a causal-LM folder is freshly initialised under a fixed seed, so every
    rank builds the same head; the global RNG state is left untouched."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"ModelConfig.path={path!r} is not an HF model folder "
                                f"(no config.json)")
    vision_language = is_vision_language(AutoConfig.from_pretrained(path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if vision_language:  # a critic: the LM head becomes the value head
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementations(attn_implementation))
            if is_critic:
                model.lm_head = _value_head(model.config.get_text_config(), dtype)
            return model
        if is_critic:
            config = AutoConfig.from_pretrained(path, num_labels=1)
            config.classifier_dropout = 0.0  # values must be deterministic in train mode
            return AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=dtype, attn_implementation=attn_implementation)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                    attn_implementation=attn_implementation)


def _value_head(text_config: Any, dtype: torch.dtype) -> torch.nn.Linear:
    """hidden -> 1, initialised as transformers initialises a token-classification head."""
    head = torch.nn.Linear(text_config.hidden_size, 1, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=getattr(text_config, "initializer_range", 0.02))
    torch.nn.init.zeros_(head.bias)
    return head


@dataclass(frozen=True)
class ServedPiece:
    """One tensor of the model's HF folder: `name` as the folder (and a server) spells it,
    cut from the model's parameter `param`."""

    name: str
    param: str
    shape: tuple[int, ...]


def served_layout(model: PreTrainedModel, names: list[str],
                  shapes: list[tuple[int, ...]]) -> list[ServedPiece]:
    """Each parameter as the model's HF folder holds it: transformers renames some on load
    and back on save (Qwen2-VL: `model.visual.*` <-> `visual.*`, `model.language_model.*` <->
    `model.*`) and fuses a mixture of experts' per-expert weights into one 3-D tensor per
    layer (split again on save); a server loads weights under the folder's names."""
    from transformers.core_model_loading import revert_weight_conversion

    pieces = []
    for name, shape in zip(names, shapes, strict=True):
        reverted = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
        pieces += [ServedPiece(saved, name, tuple(t.shape)) for saved, t in reverted.items()]
    return pieces


def served_pieces(model: PreTrainedModel, name: str,
                  full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The folder's tensors cut from parameter `name`'s full value (see `served_layout`)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, {name: full}))


def iter_served_buckets(model: PreTrainedModel, layout: list[ServedPiece],
                        buckets: Sequence[Sequence[ParamSpec]], is_rank0: bool
                        ) -> Iterator[Optional[list[torch.Tensor]]]:
    """Collective: each bucket's tensors (the folder's, see `served_layout`) at rank 0, None
    elsewhere; every rank gathers each sharded parameter once, in the same order."""
    params = dict(model.named_parameters())
    owner = {piece.name: piece.param for piece in layout}
    n_pieces = collections.Counter(piece.param for piece in layout)
    renamed = {piece.param for piece in layout if n_pieces[piece.param] == 1
               and piece.shape == tuple(params[piece.param].shape)}  # sent as they are
    gathered: tuple[str, dict[str, torch.Tensor]] = ("", {})  # the last parameter's pieces
    for bucket in buckets:
        tensors = []
        for spec in bucket:
            if spec.name not in owner:
                raise KeyError(f"weight bucket names {spec.name!r}, which the model lacks")
            name = owner[spec.name]
            if gathered[0] != name:  # a fused parameter's pieces may span buckets
                p = params[name].detach()
                full = p.full_tensor() if isinstance(p, DTensor) else p  # collective
                gathered = (name, {spec.name: full} if name in renamed
                            else served_pieces(model, name, full))
            tensors.append(gathered[1][spec.name])
        yield tensors if is_rank0 else None
        del tensors


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded weights on CPU at rank 0 (an empty dict elsewhere)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    assert all(isinstance(value, torch.Tensor) for value in state.values())
    return cast(dict[str, torch.Tensor], state)


def write_hf_folder(model: Any, state_dict: dict[str, torch.Tensor], path: str,
                    tokenizer: Any = None, copy_tokenizer_from: Optional[str] = None,
                    processor_from: Optional[str] = None) -> None:
    """Rank 0 only: safetensors + config (+ tokenizer, given or copied; + the image
    processor of a vision-language model folder `processor_from`) at `path`."""
    os.makedirs(path, exist_ok=True)
    # transformers 5 empties the dict it is given: hand it a shallow copy.
    model.save_pretrained(path, state_dict=dict(state_dict), safe_serialization=True)
    write_flat_config(path)  # a Qwen2-VL folder SGLang can start from
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    copies = ((None if tokenizer is not None else copy_tokenizer_from, TOKENIZER_FILES),
              (processor_from, PROCESSOR_FILES))
    for source, names in copies:
        if not source:
            continue
        for name in names:
            src = os.path.join(source, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def load_hf_weights(model: torch.nn.Module, path: str, is_critic: bool) -> None:
    """Collective: load an HF folder's weights into the (sharded) model on every rank."""
    ref = load_hf_model(path, is_critic, next(model.parameters()).dtype, "sdpa")
    set_model_state_dict(model, ref.state_dict(),
                         options=StateDictOptions(full_state_dict=True, strict=True))


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_dcp(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, extra: dict[str, Any], with_optim: bool,
             async_group: Optional[dist.ProcessGroup] = None) -> Optional[Future]:
    """Collective: sharded model (+ optimizer) through DCP; scheduler, RNG and `extra` per rank.

    With `async_group` (a process group of its own: the write's collectives run in a
    background thread beside training's) DCP's `async_save`: the state is staged (copied) to
    host memory before this returns, and the returned future completes once it is written."""
    os.makedirs(path, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        state["optim"] = optim_sd
    local = {"rng": _rng_state(), "scheduler": scheduler.state_dict(), "extra": extra,
             "with_optim": with_optim}
    torch.save(local, Path(path) / f"engine_state_rank{dist.get_rank()}.pt")
    if async_group is None:
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        return None
    return cast(Future, dcp.async_save(state, checkpoint_id=path, process_group=async_group))


class DcpWrites:
    """An engine's DCP checkpoints, written synchronously or beside training (async_save):
    at most one write pending; a later save, a load, or `wait` waits for it first."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: Optional[Future] = None
        self._group: Optional[dist.ProcessGroup] = None  # the background writes' own

    def save(self, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, extra: dict[str, Any], with_optim: bool,
             asynchronous: bool) -> None:
        self.wait()
        if asynchronous and self._group is None:  # collective, once: gloo moves host memory
            self._group = dist.new_group(backend="gloo")
        self._pending = save_dcp(path, model, optimizer, scheduler, extra, with_optim,
                                 self._group if asynchronous else None)

    def wait(self) -> None:
        """Collective: the pending write is complete on every rank (its error raised here)."""
        if self._pending is None:
            return
        self._pending.result(timeout=self.timeout_s)
        self._pending = None
        dist.barrier()

    def written(self, device: torch.device) -> bool:
        """Collective, without waiting: whether every rank's pending write is complete (then
        it is no longer pending). Asked over the trainer's group, not the writes' own, which
        the background thread may be using at that moment."""
        if self._pending is None:
            return True
        if all_reduce_scalar(0.0 if self._pending.done() else 1.0, device, "max") > 0:
            return False
        self.wait()
        return True


def load_dcp(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, with_optim: bool) -> dict[str, Any]:
    """Collective: restore what `save_dcp` wrote; returns the saved `extra` dict."""
    local_file = Path(path) / f"engine_state_rank{dist.get_rank()}.pt"
    if not local_file.is_file():
        raise FileNotFoundError(f"{local_file} not found: {path!r} is not a DCP checkpoint "
                                f"written by FSDPEngine.save with the same world size")
    local = torch.load(local_file, weights_only=False)
    if with_optim and not local["with_optim"]:
        raise ValueError(f"checkpoint {path!r} was saved without optimizer state; load it "
                         f"with SaveLoadMeta(with_optim=False)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=path)
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        scheduler.load_state_dict(local["scheduler"])
    else:
        set_model_state_dict(model, state["model"])
    _set_rng_state(local["rng"])
    return local["extra"]
