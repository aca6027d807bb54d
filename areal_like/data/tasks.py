"""One place that turns a `DatasetConfig` into (dataset, reward function)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from datasets import Dataset

from areal_like import rewards
from areal_like.api.config import DatasetConfig
from areal_like.api.task_keys import ADDITION_DEFAULTS, SHAPES_DEFAULTS, unknown_parameters
from areal_like.data.addition import load_addition
from areal_like.data.gsm8k import load_gsm8k
from areal_like.data.item_checks import check_items
from areal_like.data.memory_episodes import load_memory_demos, load_memory_episodes
from areal_like.data.reasoning_gym_tasks import load_reasoning_gym
from areal_like.data.shapes import load_shapes
from areal_like.utils.imports import load_object

RewardFn = Callable[..., float]


@dataclass
class Task:
    dataset: Dataset
    reward_fn: RewardFn


def build_task(config: DatasetConfig, reward_fn: str = "", name: str = "dataset") -> Task:
    """The dataset and verifier that `config.type` names; `reward_fn` (an import path,
    `reward.fn`) replaces the verifier. Items are checked here, where they enter (`name`, the
    config section, names the task in errors)."""
    task = _build(config)
    if reward_fn:
        task.reward_fn = load_object(reward_fn, "reward.fn")
    check_items(task.dataset, task.reward_fn, f"{name} (type={config.type})")
    return task


def _user_task(config: DatasetConfig) -> Task:
    """`type: my_pkg.tasks:make_task`: make_task(split=, size=, seed=, **task_kwargs) returns a
    Task, or a Dataset / list of dict items (then `reward.fn` names the verifier)."""
    make = load_user_task(config)
    made = make(split=config.split, size=config.size, seed=config.seed, **config.task_kwargs)
    if isinstance(made, Task):
        return made
    dataset = Dataset.from_list(made) if isinstance(made, list) else made
    if not isinstance(dataset, Dataset):
        raise TypeError(f"task {config.type!r} returned {type(made).__name__}; expected a Task, "
                        f"a datasets.Dataset or a list of dict items")
    return Task(dataset, _needs_reward_fn)


def load_user_task(config: DatasetConfig) -> Callable[..., Any]:
    """The task function `config.type` names, its signature checked against what it will be
    given (split, size, seed and `task_kwargs`): a typo is named before anything is built."""
    make = load_object(config.type, "train_dataset.type / valid_dataset.type")
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return make
    given = {"split", "size", "seed", *config.task_kwargs}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = [n for n, p in params.items() if p.kind is not p.POSITIONAL_ONLY]
        unknown = sorted(given - set(accepted))
        if unknown:
            raise TypeError(unknown_parameters(f"task {config.type!r}", unknown,
                                               [n for n in accepted
                                                if n not in ("split", "size", "seed")])
                            + " (it is called with split=, size=, seed= and task_kwargs)")
    missing = [n for n, p in params.items() if p.default is p.empty and n not in given
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
    if missing:
        raise TypeError(f"task {config.type!r} requires {missing}, which nothing gives: set "
                        f"them under task_kwargs (it is called with split=, size=, seed= and "
                        f"task_kwargs)")
    return make


def _needs_reward_fn(prompt: str, completion: str, **_: object) -> float:
    raise RuntimeError("this task gave no verifier: set reward.fn=my_pkg.rewards:score (with "
                       "evaluation.verifier=training: `task` asks held-out answers for the "
                       "task's own verifier)")


def _build(config: DatasetConfig) -> Task:
    if config.type == "addition":
        params = {**ADDITION_DEFAULTS, **config.task_kwargs}
        return Task(load_addition(params["num_digits"], config.size, config.split, config.seed,
                                  params["worked_fraction"]), rewards.exact_match_reward)
    if config.type == "gsm8k":
        if not config.path:
            raise ValueError("DatasetConfig.path must name a .jsonl/.parquet file for type=gsm8k")
        return Task(load_gsm8k(config.path, config.size), rewards.math_verify_reward)
    if config.type == "shapes":  # images: the vision-language workflow (docs/vision.md)
        params = {**SHAPES_DEFAULTS, **config.task_kwargs}
        return Task(load_shapes(config.size, config.split, config.seed, params["question"],
                                float(params["worked_fraction"])),
                    rewards.exact_match_reward)
    if config.type == "memory_agent":
        return Task(load_memory_episodes(config.size, config.split, config.seed), _own_reward)
    if config.type == "memory_agent_demos":  # SFT: the memory agent's tool-call format
        return Task(load_memory_demos(config.size, config.split, config.seed), _own_reward)
    if not config.type.startswith("reasoning_gym:"):
        return _user_task(config)
    name = config.type.split(":", 1)[1]
    # disjoint by a hash of the question; different seeds only vary the order
    seed = config.seed if config.split == "train" else config.seed + 1_000_003
    return Task(load_reasoning_gym(name, config.size, seed, config.split,
                                   dict(config.task_kwargs)), rewards.reasoning_gym_reward)


def _own_reward(prompt: str, completion: str, **_: object) -> float:
    raise RuntimeError("this task's workflow computes its own reward (e.g. the memory agent)")
