"""Tests build a `RolloutConfig` from the flat keys they have always passed
(`max_head_offpolicyness=1, request_timeout=5`): each is placed in its section
(`ROLLOUT_MOVED_KEYS`), so a test states what it tunes, not where it lives."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_like.api.rollout_config import ROLLOUT_MOVED_KEYS, RolloutConfig


def rollout_config(**keys: Any) -> RolloutConfig:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        if key in ROLLOUT_MOVED_KEYS:
            section, _, leaf = ROLLOUT_MOVED_KEYS[key].partition(".")
            sections.setdefault(section, {})[leaf] = value
        else:
            top[key] = value
    config = RolloutConfig(**top)
    for section, values in sections.items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    return config
