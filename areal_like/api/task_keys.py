"""Which dataset keys mean something for which task type (for checks and typo hints)."""

from __future__ import annotations

import difflib
from typing import Any

ADDITION_DEFAULTS = {"num_digits": 2, "worked_fraction": 0.0}
SHAPES_DEFAULTS = {"question": "colour", "worked_fraction": 0.0}
# the built-in task types (`DatasetConfig.type`) and their generator parameters
OWN_TASK_PARAMETERS = {"addition": tuple(ADDITION_DEFAULTS), "gsm8k": (),
                       "memory_agent": (), "memory_agent_demos": (),
                       "shapes": tuple(SHAPES_DEFAULTS)}
# dataset fields read by one task type only (its generator parameters live in task_kwargs)
TYPE_FIELDS = {"path": "gsm8k"}


def keys_for_task(dataset_fields: list[str], task_type: Any) -> tuple[list[str], list[str]]:
    """(the dataset fields that mean something for `task_type`, its generator parameters,
    set under task_kwargs)."""
    fields = [f for f in dataset_fields if TYPE_FIELDS.get(f, task_type) == task_type]
    if task_type in OWN_TASK_PARAMETERS:
        return fields, list(OWN_TASK_PARAMETERS[task_type])
    if isinstance(task_type, str) and task_type.startswith("reasoning_gym:"):
        try:
            from reasoning_gym.factory import DATASETS
            config_cls = DATASETS[task_type.split(":", 1)[1]][1]
        except (ImportError, KeyError):
            return fields, []
        return fields, [f for f in config_cls.__dataclass_fields__ if f not in ("seed", "size")]
    return fields, []


def unknown_parameters(task: str, unknown: list[str], accepted: list[str]) -> str:
    """The error for task_kwargs a task does not take, each with its closest parameter."""
    close = {u: difflib.get_close_matches(u, accepted, n=1) for u in unknown}
    hints = [f"{u!r} (did you mean {c[0]!r}?)" if c else repr(u) for u, c in close.items()]
    return f"{task} has no parameter {', '.join(hints)} (task_kwargs); its parameters: {accepted}"
