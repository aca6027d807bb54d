"""A run's datasets as training and evaluation read them (shared by a training run and
`areal-like eval`, so both evaluate on the same items with the same verifier)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from transformers import PreTrainedTokenizerBase

from areal_like.api.config import BaseExperimentConfig
from areal_like.data.loader import head_items
from areal_like.data.prompt_limits import limit_prompt_length
from areal_like.data.tasks import Task, build_task
from areal_like.rewards.remote_rm import remote_reward_fn


def remote_reward(config: BaseExperimentConfig) -> Optional[Callable[..., Any]]:
    """The remote reward model that replaces every task's verifier, if one is configured."""
    return remote_reward_fn(config.reward) if config.reward.remote_rm_url else None


def load_task(config: BaseExperimentConfig, name: str, tokenizer: PreTrainedTokenizerBase,
              reward: Optional[Callable[..., Any]] = None) -> tuple[Task, int]:
    """`config.<name>` (train_dataset / valid_dataset) built, its verifier replaced by
    `reward` (or `reward.fn`) when given — except held-out answers with
    `evaluation.verifier=task`, which keep the task's own — prompts over its `max_prompt_len`
    dropped: (task, how many)."""
    dataset_config = getattr(config, name)
    task_verifier = name == "valid_dataset" and config.evaluation.verifier == "task"
    task = build_task(dataset_config, "" if task_verifier else config.reward.fn, name)
    if reward is not None and not task_verifier:
        task.reward_fn = reward
    task.dataset, dropped = limit_prompt_length(task.dataset, tokenizer, dataset_config, name)
    return task, dropped


def eval_items(config: BaseExperimentConfig, dataset: Any) -> list[dict[str, Any]]:
    """The held-out items evaluated: the first `evaluation.n_prompts` of `valid_dataset`."""
    valid = config.valid_dataset
    return head_items(dataset, config.evaluation.n_prompts, valid.shuffle, valid.seed)


def held_out_items(config: BaseExperimentConfig, tokenizer: PreTrainedTokenizerBase
                   ) -> tuple[list[dict[str, Any]], Callable[..., Any]]:
    """(the evaluated items, their verifier), as a training run's evaluation has them."""
    task, _ = load_task(config, "valid_dataset", tokenizer, remote_reward(config))
    return eval_items(config, task.dataset), task.reward_fn
