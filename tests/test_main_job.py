"""The main job in miniature, through the launcher: SFT warm start, then asynchronous GRPO on
a real SGLang server; held-out greedy accuracy and training reward must rise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _launch(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "areal_like.launcher.local", *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.sglang
@pytest.mark.slow
def test_async_grpo_after_sft_raises_accuracy(tiny_model_dir, tmp_path):
    logs = tmp_path / "runs"
    _launch("sft", f"model.path={tiny_model_dir}", f"logging.log_dir={logs}",
            "logging.tensorboard=false", "evaluation.freq_steps=100")
    warm = logs / "sft_addition" / "trial0" / "final"
    out = _launch("grpo", f"model.path={warm}", f"logging.log_dir={logs}",
                  "total_train_steps=60", "evaluation.freq_steps=60", "evaluation.n_prompts=100",
                  "checkpoint.freq_steps=0", "logging.tensorboard=false")
    assert "eval/accuracy:" in out and "curves:" in out
    records = [json.loads(line)
               for line in (logs / "grpo_addition" / "trial0" / "metrics.jsonl").open()]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(accuracy) == 2
    assert accuracy[1] >= accuracy[0] + 0.1, accuracy
    rewards = [r["actor/task_reward/avg"] for r in records if "actor/task_reward/avg" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
    assert max(r.get("rollout/staleness_max", 0) for r in records) <= 2  # eta = 2
