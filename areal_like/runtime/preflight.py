"""What a recipe's trainer would refuse, found from the config before any process starts.

The trainer checks these too, but only after the servers have started (minutes on a busy
machine): here a typo costs seconds. Each error is a `ConfigError` naming the key and, where
there is one, the closest valid value.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Any

from areal_like.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, check_actor_config
from areal_like.api.config import IMPORT_PATH
from areal_like.api.config_loader import ConfigError
from areal_like.data.gsm8k import load_gsm8k
from areal_like.data.preference import load_pairs, pair_rows
from areal_like.data.tasks import build_task, load_user_task
from areal_like.runtime.preflight_models import check_model_folders
from areal_like.utils.imports import load_object
from areal_like.utils.trackers import check_trackers

DATASETS = ("train_dataset", "valid_dataset")
PAIR_SECTIONS = ("pairs", "valid_pairs")  # preference pairs (recipes.rm, recipes.dpo)
GENERATED = ("addition", "memory_agent", "memory_agent_demos", "shapes")
REASONING_GYM = "reasoning_gym:"  # a task type, though it looks like an import path


def check_recipe_config(config: Any) -> None:
    """User code importable, data files readable, generated tasks able to give their sizes
    with their parameters, algorithm names registered and the actor's combinations accepted
    (in this order: a user module may register names)."""
    for key, path in _import_paths(config):
        try:
            load_object(path, key)
        except (ImportError, ValueError) as e:
            raise ConfigError(str(e)) from None
    unread = getattr(config, "UNREAD_DATASETS", ())  # e.g. the pair recipes' train_dataset
    for name in DATASETS:
        dataset = None if name in unread else getattr(config, name, None)
        if dataset is not None and dataset.type == "gsm8k":
            _check_data_file(f"{name}.path", dataset.path)
        elif dataset is not None and _generated(dataset.type):
            _check_generated(name, dataset, config.reward.fn)
        elif dataset is not None and IMPORT_PATH.match(dataset.type):
            try:  # a task of your own may be slow to build: its signature is checked
                load_user_task(dataset)
            except TypeError as e:
                raise ConfigError(f"{name}: {e}") from None
    check_model_folders(config)  # LoRA targets, vision tower, the teacher's tokenizer
    if getattr(config, "logging", None) is not None:
        _check_writable_folder("logging.log_dir", config.logging.log_dir)
        _check_tracker_folders(config.logging)
        try:  # trackers installed, an MLflow server answering
            check_trackers(config.logging)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for name in PAIR_SECTIONS:
        if getattr(config, name, None) is not None:
            _check_pairs(config, name)
    algorithm = getattr(config, "algorithm", None)
    if algorithm is None:
        return
    for key, name, registry in (("adv.estimator", algorithm.adv.estimator, ADVANTAGE_ESTIMATORS),
                                ("loss.policy", algorithm.loss.policy, POLICY_LOSSES)):
        _check_registered(f"algorithm.{key}", name, registry.names())
    try:
        # a reference model, or a distillation teacher in its place
        has_ref = bool(getattr(config, "use_ref_model", False)) or hasattr(config, "teacher")
        check_actor_config(algorithm, has_ref=has_ref)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _import_paths(config: Any) -> list[tuple[str, str]]:
    """(key, import path) of every piece of user code the config names."""
    found = [("reward.fn", config.reward.fn), ("rollout.workflow", config.rollout.workflow)]
    found += [(f"{name}.type", getattr(config, name).type) for name in DATASETS
              if IMPORT_PATH.match(getattr(config, name).type)
              and not getattr(config, name).type.startswith(REASONING_GYM)]
    return [(key, path) for key, path in found if path]


def _check_pairs(config: Any, name: str) -> None:
    """Every pair of a file checked (the error names its line) and a generated pair task
    able to give its size: in seconds, before any engine or process starts."""
    pairs = getattr(config, name)
    try:
        if pairs.type == "file":
            from transformers import AutoConfig

            from areal_like.data.prompt_limits import load_tokenizer

            load_pairs(pairs, load_tokenizer(config.model),
                       AutoConfig.from_pretrained(config.actor.model.path), name,
                       add_eos=config.RESPONSES_END_WITH_EOS)
        else:
            pair_rows(pairs, name)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{name} (type={pairs.type}): {e}") from None


def _generated(task_type: str) -> bool:
    """A built-in task whose items are generated here in seconds (sizes and generator
    parameters are checked by generating them; a task of your own may be slow to build)."""
    return task_type in GENERATED or task_type.startswith(REASONING_GYM)


def _check_generated(name: str, dataset: Any, reward_fn: str) -> None:
    try:
        build_task(dataset, reward_fn, name)  # a size past the distinct questions, a typo in
    except (ValueError, TypeError, KeyError) as e:  # task_kwargs, an unknown task name
        raise ConfigError(f"{name} (type={dataset.type}): {e}") from None


def _check_data_file(key: str, path: str) -> None:
    if not path:
        raise ConfigError(f"{key} is empty: type=gsm8k needs a .jsonl/.json/.parquet file")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}={path!r}: no such file (working directory {os.getcwd()})")
    try:
        load_gsm8k(str(file), 0)  # every row checked, errors name file:line
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None


def _check_writable_folder(key: str, value: str, folder_in_value: str = "") -> None:
    """The folder `value` (or `folder_in_value`, the folder it names) can be made: no file in
    its way, its nearest existing folder writable."""
    path = Path(folder_in_value or value).absolute()
    for folder in (path, *path.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise ConfigError(f"{key}={value!r}: {folder} is a file, not a folder; choose "
                              f"another")
        try:  # a probe file, not os.access: root passes that check where writes fail
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise ConfigError(f"{key}={value!r}: {folder} is not writable "
                              f"({e.strerror})") from None
        return


def _check_tracker_folders(logging_config: Any) -> None:
    """Where an enabled tracker writes locally can be written (else every metric it was sent
    would be lost once the run has started)."""
    if logging_config.trackio.enabled and logging_config.trackio.dir:
        _check_writable_folder("logging.trackio.dir", logging_config.trackio.dir)
    uri = logging_config.mlflow.tracking_uri
    if logging_config.mlflow.enabled and uri.startswith("sqlite:///"):
        database = Path(uri[len("sqlite:///"):])
        _check_writable_folder("logging.mlflow.tracking_uri", uri, str(database.parent))


def check_local_trainer_device(config: Any) -> None:
    """For a trainer started on this machine: GPU-only settings refused where torch sees no
    CUDA device, as the trainer would once the servers are up (torch is imported only when
    such a setting is set)."""
    engines = {name: getattr(config, name, None) for name in ("actor", "critic", "ref")}
    asked = [(f"{name}.{key}", getattr(engine, key)) for name, engine in engines.items()
             if hasattr(engine, "cpu_offload")
             for key in ("backend", "cpu_offload", "activation_offload")
             if getattr(engine, key) in (True, "nccl")]
    if not asked:
        return
    import torch

    if torch.cuda.is_available():
        return
    key, value = asked[0]
    if value == "nccl":
        raise ConfigError(f"{key}=nccl: no CUDA device is visible on this machine; use auto "
                          f"(gloo on CPU)")
    raise ConfigError(f"{key}=true on a CPU trainer (no CUDA device is visible): its state "
                      f"already lives in host memory; unset it (offloading is for GPU trainers)")


def _check_registered(key: str, name: str, names: list[str]) -> None:
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"{key}={name!r} is not registered; {hint}registered: {names} (a name of "
                      f"your own must be registered by a module the config imports, e.g. "
                      f"reward.fn's)")
