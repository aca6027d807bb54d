"""What a new user does, through the public entry points only: a task, a reward and a workflow
in a module of their own (outside the project), YAMLs in their own folder extending the shipped ones, an
SFT warm start on the task, then a few asynchronous GRPO steps through the launcher (on the
session's SGLang fleet, loaded with the warm start at version 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_helpers import attach_args, reset_fleet

from areal_like.utils.metrics_logger import read_metrics

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

MY_TASK = '''
"""My task: one-digit sums from reasoning-gym (non-default parameters), my own reward."""
import re

from areal_like.data.reasoning_gym_tasks import load_reasoning_gym
from workflows import RLVRWorkflow


def make_task(split, size, seed, max_terms=2):
    return load_reasoning_gym("basic_arithmetic", size, seed, split,
                              {"min_terms": 2, "max_terms": max_terms, "max_digits": 1,
                               "operators": ["+"]})


def score(prompt, completion, answer, **_):
    """The exact integer: 1; anything else: -0.5 (no partial credit)."""
    found = re.findall(r"-?\\d+", completion)
    return 1.0 if found and found[-1] == answer.strip() else -0.5


class DoubledRewards(RLVRWorkflow):
    """My workflow: RLVR with every (successful) reward doubled."""

    async def score(self, prompt, responses, data):
        rewards = await super().score(prompt, responses, data)
        return [2 * r if isinstance(r, float) else r for r in rewards]
'''

TASK_YAML = """
train_dataset:
  type: my_task:make_task
  task_kwargs: {max_terms: 2}
  size: 400
valid_dataset:
  type: my_task:make_task
  split: test
  size: 16
  shuffle: false
evaluation:
  n_prompts: 16
"""


def _run(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # only the user's folder (the working directory) helps
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_own_task_and_reward_sft_then_async_grpo(tiny_model_dir, tmp_path, fresh_fleet):
    home = tmp_path / "my_project"
    (home / "configs").mkdir(parents=True)
    (home / "my_task.py").write_text(MY_TASK)
    (home / "configs" / "sft.yaml").write_text(
        "defaults:\n  - sft_addition\n  - _self_\ntotal_train_steps: 20\n" + TASK_YAML
        + "  freq_steps: 20\nlogging:\n  experiment_name: my_sft\n  log_dir: runs\n")
    (home / "configs" / "rl.yaml").write_text(
        "defaults:\n  - grpo_addition\n  - _self_\ntotal_train_steps: 3\n" + TASK_YAML
        + "  freq_steps: 3\nreward:\n  fn: my_task:score\ngconfig:\n  n_samples: 4\n"
        "  max_new_tokens: 6\nrollout:\n  staleness:\n    consumer_batch_size: 4\n"
        "  workflow: my_task:DoubledRewards\n"
        "logging:\n  experiment_name: my_rl\n  log_dir: runs\n  tensorboard: false\n"
        "  plot: false\n")

    _run(["-m", "recipes.sft", "--config-path", "configs", "--config-name", "sft",
          f"model.path={tiny_model_dir}", "train_dataset.batch_size=16"], home)
    sft = read_metrics(home / "runs" / "my_sft" / "trial0" / "metrics.jsonl")
    assert sft[-1]["step"] == 20 and "eval/accuracy" in sft[-1]
    warm = home / "runs" / "my_sft" / "trial0" / "final"
    assert (warm / "config.json").is_file()

    # the session fleet, as new with the warm start (what the launcher would start)
    reset_fleet(fresh_fleet, warm)
    out = _run(["-m", "areal_like.launcher.local", "grpo", "--config", "configs/rl.yaml",
                f"model.path={warm}", "train_dataset.batch_size=4", *attach_args(fresh_fleet)],
               home)
    rl = read_metrics(home / "runs" / "my_rl" / "trial0" / "metrics.jsonl")
    steps = [r for r in rl if "actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2, 3], out[-3000:]
    # my reward (-0.5 / 1, not the task's verifier) through my workflow (doubled)
    rewards = {r["actor/task_reward/min"] for r in steps} | {r["actor/task_reward/max"]
                                                            for r in steps}
    assert rewards <= {-1.0, 2.0} and -1.0 in rewards
    assert any("eval/accuracy" in r for r in rl)
