"""DPO as a user runs it (`areal-like run dpo`, two torchrun ranks): the reference's log-probs
computed once, split over the ranks and gathered, give a first loss of exactly log 2 on every
rank; held-out pairs are then ranked. Runs beside the serial lane: no session fleet."""

from __future__ import annotations

import math

import pytest
from test_preference_recipes import _evals, _launch

pytestmark = [pytest.mark.e2e, pytest.mark.beside_serial]


def test_dpo_starts_at_log_two_and_learns_with_its_reference_computed_once(tiny_model_dir,
                                                                         tmp_path):
    records = _launch("dpo", tiny_model_dir, tmp_path / "full", "launcher.n_trainer_procs=2",
                      "total_train_steps=60", "pairs.batch_size=16", "actor.optimizer.lr=2e-3",
                      "loss.beta=0.5", "evaluation.freq_steps=20", "valid_dataset.size=8")
    # the first step's policy is its reference: h = 0 for every pair on both ranks, whose
    # reference log-probs were computed apart and gathered
    assert abs(records[1]["dpo/train/loss"] - math.log(2)) < 1e-5
    accuracy = _evals(records, "eval/pair_accuracy")  # 0 at step 0: every pair a tie
    assert accuracy[-1] >= 0.65, accuracy  # measured 0.72-0.81 (chance 0.5)
    assert records[-1]["dpo/train/loss"] < 0.5 * math.log(2)
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    assert (tmp_path / "full" / "dpo_addition" / "trial0" / "final" / "config.json").is_file()
    # (with LoRA the reference is the actor's own base: tests/test_preference_losses.py)
