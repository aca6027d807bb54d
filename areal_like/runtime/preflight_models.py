"""The checks of a config against the model folders it names, before any process starts.

What the trainer or a server would find only after start-up (a LoRA target the model lacks, a
vision workflow on a text-only model, a teacher that does not share the student's tokenizer, a
top-k past the vocabulary) is read here from the folders' `config.json` and tokenizer files.
A folder that does not exist yet is left to the launcher's own check (`model.path`) or to the
server that loads it; each error is a `ConfigError` naming the keys involved.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from areal_like.api.config_loader import ConfigError
from areal_like.utils.imports import load_object

IMAGE_TASKS = ("shapes",)  # dataset types whose prompts hold images
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json")


def check_model_folders(config: Any) -> None:
    """Every check of this module that applies to `config` (a recipe's)."""
    model = read_model_config(config.model.path)
    _check_vision(config, model)
    _check_parallel(config, model)
    if model is not None:
        _check_shape_dependent_keys(config, model)
    actor = getattr(config, "actor", None)
    if actor is not None and actor.lora.enabled and model is not None:
        _check_lora_targets(actor.lora.target_modules, config.model.path)
    teacher = getattr(config, "teacher", None)
    if teacher is not None and not teacher.server_addrs:
        _check_teacher(teacher, config.model)


def _check_parallel(config: Any, model: Optional[dict[str, Any]]) -> None:
    """Each trainer engine's mesh against the trainer's world size and the model's heads (the
    engine's own checks, from config.json: engines/fsdp/mesh.py)."""
    # under torchrun the job's size; launched by us, the ranks the launcher will start
    world = int(os.environ.get("WORLD_SIZE") or config.launcher.n_trainer_procs)
    sections = [name for name in ("actor", "critic", "ref") if hasattr(config, name)
                and (name != "ref" or getattr(config, "use_ref_model", False))]
    for name in sections:
        parallel = getattr(config, name).parallel
        try:
            parallel.data_parallel_size(world, name)
            if model is not None and parallel.model_parallel_size > 1:
                # (imports the engine's checks: transformers, ~2 s, only for such a mesh)
                from engines.fsdp.mesh import check_model_fits_mesh

                path = getattr(config, name).model.path or config.model.path
                own = model if path == config.model.path else read_model_config(path)
                if own is None:
                    continue
                text = SimpleNamespace(**{**own, **(own.get("text_config") or {})})
                check_model_fits_mesh(parallel, text, path, name, getattr(config, name).lora.rank)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_shape_dependent_keys(config: Any, model: dict[str, Any]) -> None:
    """Keys that mean something only for some models: routed experts of a mixture of experts
    (a dense model's server crashes at start when asked for them), a checkpointing stride
    within the decoder's layers."""
    text = {**model, **(model.get("text_config") or {})}
    experts = text.get("num_experts") or text.get("num_local_experts")
    rollout = getattr(config, "rollout", None)
    if rollout is not None and rollout.return_routed_experts and not experts:
        raise ConfigError(
            f"rollout.return_routed_experts=true, but model.path={config.model.path!r} is not a "
            f"mixture of experts (its config.json names no num_experts; model_type="
            f"{model.get('model_type')!r}): leave it false (docs/algorithms.md)")
    layers = text.get("num_hidden_layers")
    for name in ("actor", "critic", "ref"):
        engine = getattr(config, name, None)
        every = getattr(engine, "gradient_checkpointing_every", 1) if engine else 1
        if engine is not None and engine.gradient_checkpointing and isinstance(layers, int) \
                and every > layers:
            raise ConfigError(
                f"{name}.gradient_checkpointing_every={every} is past the model's "
                f"{layers} decoder layers (model.path={config.model.path!r}): at most "
                f"{layers} (every N-th layer is checkpointed)")


def read_model_config(path: str) -> Optional[dict[str, Any]]:
    """The folder's config.json, or None when there is none (checked elsewhere)."""
    file = Path(path) / "config.json"
    if not path or not file.is_file():
        return None
    try:
        loaded = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not readable as JSON ({e})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(loaded).__name__}")
    return loaded


def vocab_size(model: dict[str, Any]) -> Optional[int]:
    """The number of token ids the model scores (a VLM keeps it in its text config)."""
    size = model.get("vocab_size") or (model.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def _check_vision(config: Any, model: Optional[dict[str, Any]]) -> None:
    workflow_path = config.rollout.workflow
    workflow = load_object(workflow_path, "rollout.workflow") if workflow_path else None
    needs_images = bool(getattr(workflow, "needs_images", False))
    image_sets = [name for name in ("train_dataset", "valid_dataset")
                  if getattr(config, name).type in IMAGE_TASKS]
    has_tower = model is not None and "vision_config" in model
    if image_sets and not needs_images and _runs_rollouts(config):
        name = image_sets[0]
        raise ConfigError(
            f"{name}.type={getattr(config, name).type!r} has images in its prompts, but "
            f"rollout.workflow={workflow_path or '(the recipe default)'!r} sends text only: "
            f"set rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow (or "
            f"workflows.vision_prm:VisionPRMWorkflow for ppo_prm; docs/vision.md)")
    if (needs_images or image_sets) and model is not None and not has_tower:
        what = (f"rollout.workflow={workflow_path!r}" if needs_images
                else f"{image_sets[0]}.type={getattr(config, image_sets[0]).type!r}")
        raise ConfigError(
            f"{what} needs a vision-language model (images in the prompt), but model.path="
            f"{config.model.path!r} is a text-only model (its config.json has no "
            f"vision_config; model_type={model.get('model_type')!r}); use a VLM such as "
            f"`python -m areal_like.models.tiny_vl --out DIR` (docs/vision.md)")
    if needs_images and config.server.backend == "vllm" and not config.rollout.server_addrs:
        raise ConfigError(f"rollout.workflow={workflow_path!r} sends images, which vLLM "
                          f"servers refuse here (server.backend=vllm): use "
                          f"server.backend=sglang (docs/vision.md)")
    if getattr(config, "pairs", None) is not None and config.actor.model.is_critic \
            and has_tower:  # recipes.rm: its export is a text sequence classifier
        raise ConfigError(f"model.path={config.model.path!r} is a vision-language model: the "
                          f"rm recipe trains text reward models (a sequence-classification "
                          f"export)")
    for section in ("actor", "critic"):
        engine = getattr(config, section, None)
        if engine is not None and engine.freeze_vision_tower and model is not None \
                and not has_tower:
            raise ConfigError(f"{section}.freeze_vision_tower=true, but model.path="
                              f"{config.model.path!r} has no vision tower to freeze (a "
                              f"text-only model): leave it false")


def _runs_rollouts(config: Any) -> bool:
    return hasattr(config, "algorithm") and hasattr(config, "use_ref_model")  # RL recipes


def _check_lora_targets(targets: list[str], model_path: str) -> None:
    """The linear layers LoRA adapts exist (the engine would say so after start-up)."""
    names = linear_module_names(model_path)
    missing = sorted(set(targets) - names)
    if missing:
        raise ConfigError(f"actor.lora.target_modules names {missing}, which the model at "
                          f"model.path={model_path!r} does not have as linear layers (it has: "
                          f"{sorted(names)})")


def linear_module_names(model_path: str) -> set[str]:
    """The last name part of every linear layer of the model (built on the meta device: no
    weight is read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.fsdp.lora import linear_layer_names

    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return linear_layer_names(AutoModelForCausalLM.from_config(hf_config))


def _check_teacher(teacher: Any, student: Any) -> None:
    """The teacher scores the student's token ids: it must read them as the same tokens."""
    folder = teacher.model_path
    model = read_model_config(folder)
    if model is None:
        raise ConfigError(f"teacher.model_path={folder!r} is not an HF model folder (no "
                          f"config.json): set it to the teacher's folder (docs/algorithms.md "
                          f"says how to make one), or give teacher.server_addrs of a running "
                          f"teacher fleet")
    size = vocab_size(model)
    if teacher.top_k and size and teacher.top_k > size:
        raise ConfigError(f"teacher.top_k={teacher.top_k} is larger than the teacher's "
                          f"vocabulary ({size} tokens, {folder}/config.json): set it to at "
                          f"most {size} (a top-k distribution is a part of the vocabulary)")
    student_path = student.tokenizer_path or student.path
    if _tokenizer_digest(folder) != _tokenizer_digest(student_path):
        difference = _tokenizer_difference(folder, student_path)
        if difference:
            raise ConfigError(f"teacher.model_path={folder!r} does not share the student's "
                              f"tokenizer ({student_path}): {difference}; the teacher scores "
                              f"the student's token ids, so both must read them as the same "
                              f"tokens")
    student_model = read_model_config(student.path)
    student_size = vocab_size(student_model) if student_model else None
    if teacher.top_k and size and student_size and size > student_size:
        # (one tokenizer, padded embeddings of other sizes: fine for sampled tokens only)
        raise ConfigError(f"teacher.top_k={teacher.top_k} with a teacher of {size} token ids "
                          f"and a student of {student_size} (model.path={student.path!r}): "
                          f"the teacher's top tokens may be ids the student has no "
                          f"probability for; use teacher.top_k=0 (kl.estimator k1/k2/k3) or "
                          f"a teacher with the student's vocabulary size")


def _tokenizer_digest(folder: str) -> str:
    """A hash of the folder's tokenizer files (equal files: the same tokenizer)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = Path(folder) / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _tokenizer_difference(teacher_path: str, student_path: str) -> str:
    """What differs between two tokenizers whose files differ ('' if they map every token
    and special token alike: files can differ in layout only)."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_path)
    student = AutoTokenizer.from_pretrained(student_path)
    t_vocab, s_vocab = teacher.get_vocab(), student.get_vocab()
    if t_vocab != s_vocab:
        changed = sorted(set(t_vocab.items()) ^ set(s_vocab.items()), key=lambda kv: kv[1])
        token = changed[0][0]
        return (f"their vocabularies differ ({len(t_vocab)} and {len(s_vocab)} tokens; e.g. "
                f"{token!r} is {_token_id(t_vocab, token)} to the teacher and "
                f"{_token_id(s_vocab, token)} to the student)")
    specials = ("bos_token", "eos_token", "pad_token", "unk_token")
    for name in specials:
        if getattr(teacher, name, None) != getattr(student, name, None):
            return (f"their {name} differs ({getattr(teacher, name, None)!r} and "
                    f"{getattr(student, name, None)!r})")
    return ""


def _token_id(vocab: dict[str, int], token: str) -> str:
    return f"id {vocab[token]}" if token in vocab else "unknown"
