"""What the Ray launcher tells a running trainer (restart counts, which start this is), and
what a restarted trainer does with no checkpoint yet: unit tests of those two pieces."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_like.api.config import CheckpointConfig
from areal_like.runtime import recover
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.utils.atomic_file import write_atomic
from areal_like.utils.launcher_state import (
    ATTEMPT_ENV,
    STATE_ENV,
    launcher_metrics,
    trainer_attempt,
)


def test_the_counts_the_launcher_writes_are_logged_as_launcher_metrics(tmp_path, monkeypatch):
    state = tmp_path / "node" / "launcher_state.json"
    monkeypatch.delenv(STATE_ENV, raising=False)
    assert launcher_metrics() == {}  # a trainer not started by the Ray launcher
    monkeypatch.setenv(STATE_ENV, str(state))
    assert launcher_metrics() == {}  # not written yet
    write_atomic(state, json.dumps({"server_restarts": 2, "trainer_restarts": 1}))
    assert launcher_metrics() == {"launcher/server_restarts": 2.0,
                                  "launcher/trainer_restarts": 1.0}
    write_atomic(state, json.dumps({"server_restarts": 3, "trainer_restarts": 1}))
    assert launcher_metrics()["launcher/server_restarts"] == 3.0
    assert [p.name for p in state.parent.iterdir()] == [state.name]  # no scratch file left


@pytest.mark.parametrize("attempt,pushed", [("0", False), ("2", True)])
def test_a_restarted_trainer_without_a_checkpoint_loads_its_start_weights_on_the_fleet(
        tmp_path, monkeypatch, attempt, pushed):
    """The fleet kept across a trainer restart holds the dead trainer's weights: a restart
    before the first checkpoint starts over, so it must serve the start's weights as version
    0; a first start has nothing to replace."""
    monkeypatch.setenv(ATTEMPT_ENV, attempt)
    assert trainer_attempt() == int(attempt)
    calls = []
    monkeypatch.setattr(recover, "push_weights",
                        lambda engine, rollout, version, *a, **k: calls.append(version))
    config = SimpleNamespace(checkpoint=CheckpointConfig(recover="auto"),
                             actor=SimpleNamespace(collective_timeout=60.0))
    run = SimpleNamespace(config=config, weights_dir=tmp_path / "weights")
    engine = SimpleNamespace(get_version=lambda: 0)
    start = recover.maybe_recover(Checkpointer(config.checkpoint, Path(tmp_path)), run, engine,
                                  rollout=object())
    assert start == 0 and calls == ([0] if pushed else [])
