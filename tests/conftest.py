"""Shared fixtures: tiny offline models built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Co-located processes on a small machine: one thread each (see DESIGN.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1M-parameter Qwen2 model + byte-level BPE tokenizer (seed 1)."""
    from areal_like.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_1m"), size="1m", seed=1)
