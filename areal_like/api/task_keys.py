"""Which dataset keys mean something for which task type (for checks and typo hints)."""

from __future__ import annotations

from typing import Any

OWN_TASK_PARAMETERS = {"addition": ("num_digits", "worked_fraction"), "gsm8k": (),
                       "memory_agent": (), "memory_agent_demos": ()}
TASK_FIELDS = {"num_digits": 2, "worked_fraction": 0.0}  # addition's own fields, and defaults


def keys_for_task(dataset_fields: list[str], task_type: Any) -> tuple[list[str], list[str]]:
    """(the dataset fields that mean something for `task_type`, its generator parameters,
    set under task_kwargs)."""
    fields = [f for f in dataset_fields if f not in TASK_FIELDS or task_type == "addition"]
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
