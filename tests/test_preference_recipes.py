"""The reward-model stage as a user runs it: a reward model trained on pairs under torchrun,
written as an HF reward-model folder, evaluated by `areal-like eval`, served by `rm_server
--model` and driving GRPO on the real SGLang fleet. DPO's run: tests/test_dpo_recipe.py; bad
pair files refused before anything starts: tests/test_preference_data.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recipes import _run_recipe
from test_remote_rm import RMServer

from areal_like.api.preference_config import PreferenceDataConfig
from areal_like.data.preference import load_pairs
from areal_like.utils.metrics_logger import read_metrics

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
pytestmark = [pytest.mark.e2e]
# one-digit sums (93 training problems), a random 1M model: held out are other wrong answers
# (another seed) to training prompts, a ranking such a model can learn in a minute; the full
# runs on the SFT warm start, with the test split's prompts, are in docs/algorithms.md
PAIRS = ["pairs.task_kwargs.num_digits=1", "pairs.size=64", "valid_pairs.task_kwargs.num_digits=1",
         "valid_pairs.split=train", "valid_pairs.seed=2", "valid_pairs.size=32",
         "evaluation.n_prompts=32", "logging.tensorboard=false", "checkpoint.freq_steps=0"]


def _launch(recipe: str, model_dir: Path, log_dir: Path, *extra: str) -> list[dict]:
    """`areal-like run <recipe>` (the local launcher; torchrun for the trainer ranks)."""
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", recipe, f"model.path={model_dir}",
         f"logging.log_dir={log_dir}", *PAIRS, *extra],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(next(log_dir.glob("*/trial0")) / "metrics.jsonl")


def _evals(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


@pytest.mark.sglang
def test_a_trained_reward_model_is_evaluated_served_and_drives_grpo(sglang_fleet,
                                                                    tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # one trainer rank (two ranks' pair sharding and gathered reference: test_dpo_recipe.py)
    records = _launch("rm", tiny_model_dir, tmp_path / "rm",
                      "total_train_steps=100", "pairs.batch_size=16", "actor.optimizer.lr=2e-3",
                      "evaluation.freq_steps=50")
    accuracy = _evals(records, "eval/pair_accuracy")  # measured 0.56 -> 0.84 in one process
    assert accuracy[-1] >= 0.75 and accuracy[-1] >= accuracy[0] + 0.15, accuracy
    margins = _evals(records, "eval/reward_margin")
    assert margins[-1] > margins[0] + 1.0, margins
    final = tmp_path / "rm" / "rm_addition" / "trial0" / "final"

    # the folder is a sequence-classification reward model: its float64 scores of the
    # held-out pairs give the run's last evaluation
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float64)
    pairs = load_pairs(PreferenceDataConfig(size=32, seed=2, task_kwargs={"num_digits": 1}),
                       tokenizer, model.config, "valid_pairs", add_eos=False)
    with torch.no_grad():
        scores = [float(model(torch.tensor([p.prompt_ids + ids])).logits[0, 0])
                  for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    reference = [c - r for c, r in zip(scores[0::2], scores[1::2], strict=True)]
    assert sum(m > 0 for m in reference) / len(reference) == accuracy[-1]
    assert abs(sum(reference) / len(reference) - margins[-1]) < 1e-4

    evaluated = subprocess.run([sys.executable, "-m", "areal_like.cli", "eval", str(final)],
                               cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads((final.parent / "final.eval.json").read_text())
    assert record["eval/pair_accuracy"] == accuracy[-1] and record["eval/n_pairs"] == 32
    assert abs(record["eval/reward_margin"] - margins[-1]) < 1e-4

    # a causal LM is not a reward model: the server refuses it at start, naming its head
    refused = subprocess.run([sys.executable, "-m", "areal_like.rewards.rm_server", "--port",
                              "0", "--model", str(tiny_model_dir)], cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "architectures=['Qwen2ForCausalLM']" in refused.stderr
    assert "(a causal LM: a policy, not a reward model)" in refused.stderr

    server = RMServer("--model", str(final))
    try:
        grpo = _run_recipe("grpo", sglang_fleet, tiny_model_dir, tmp_path / "grpo",
                           "gconfig.max_new_tokens=4", "gconfig.n_samples=4",
                           "rollout.staleness.consumer_batch_size=2", "train_dataset.batch_size=2",
                           f"reward.remote_rm_url={server.url}", "evaluation.verifier=task")
        stats = server.stats()
    finally:
        server.close()
    assert [r["step"] for r in grpo] == [0, 1, 2] and grpo[-1]["update_successful"] == 1.0
    # the trained model's scores were the rewards (a 0/1 verifier gives neither sign nor
    # fractions), every rollout scored by the server, none failed
    rewards = [r[k] for r in grpo[1:] for k in ("actor/task_reward/min", "actor/task_reward/max")]
    assert any(v not in (0.0, 1.0) for v in rewards), rewards
    assert sum(stats["batch_sizes"]) >= 2 * 2 * 4 and grpo[-1]["rollout/failed_total"] == 0
    # held-out answers scored by the task's verifier (evaluation.verifier=task): exact match
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in grpo if "eval/accuracy" in r)
