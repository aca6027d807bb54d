"""Every RL recipe runs its loop against the session's real SGLang fleet for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_engine

from areal_like.api import WeightUpdateMeta

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _run_recipe(recipe: str, fleet, model_dir: Path, log_dir: Path, *extra: str) -> list[dict]:
    """Run `python -m recipes.<recipe>` (a one-process trainer) attached to the fleet."""
    version = fleet_version(fleet.addresses, SGLANG_TEST_API_KEY)
    args = [f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"rollout.server_addrs=[{','.join(fleet.addresses)}]",
            f"rollout.api_key={SGLANG_TEST_API_KEY}", "total_train_steps=2",
            "evaluation.freq_steps=2", "evaluation.n_prompts=4", "valid_dataset.size=8",
            "train_dataset.size=200", "logging.tensorboard=false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-m", f"recipes.{recipe}", *args], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:  # give the shared fleet its session weights back, under a fresh version
        engine = make_engine(fleet.addresses, SGLANG_TEST_API_KEY)
        engine.set_version(fleet_version(fleet.addresses, SGLANG_TEST_API_KEY))
        engine.update_weights(WeightUpdateMeta.from_disk(str(model_dir), version + 10))
        engine.destroy()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_dir = next(log_dir.glob("*/trial0"))
    assert (run_dir / "curves.png").stat().st_size > 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


SMALL = ["gconfig.max_new_tokens=4", "rollout.consumer_batch_size=2", "train_dataset.batch_size=2"]


@pytest.mark.parametrize("recipe, extra", [
    ("grpo", ["gconfig.n_samples=4"]),
    ("remax", ["gconfig.n_samples=2"]),
    ("ppo", ["gconfig.n_samples=2"]),
    ("multi_turn", ["max_turns=2"]),
    ("agent", ["gconfig.max_new_tokens=8", "max_steps=1", "train_dataset.size=20",
               "valid_dataset.size=2", "evaluation.n_prompts=2"]),
])
def test_recipe_runs_its_loop(recipe, extra, sglang_fleet, tiny_model_dir, tmp_path):
    records = _run_recipe(recipe, sglang_fleet, tiny_model_dir, tmp_path, *SMALL, *extra)
    steps = [r["step"] for r in records]
    assert steps == [0, 1, 2]
    last = records[-1]
    assert last["update_successful"] == 1.0 and last["n_tokens"] > 0
    assert "eval/accuracy" in records[0] and "eval/accuracy" in last
    assert last["rollout/version"] >= 1  # rollout saw the pushed weights
    assert last["weight_sync/export_s"] > 0
    if recipe == "ppo":
        assert "critic/loss" in last
