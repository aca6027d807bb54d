"""The SFT recipe as a user runs it: it honours the evaluation and checkpoint sections, resumes
after its last checkpoint, drops over-long prompts with a count, and prints no library bars."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from areal_like.api.config import DatasetConfig
from areal_like.data.addition import make_addition_items
from areal_like.data.loader import ItemLoader
from areal_like.data.prompt_limits import limit_prompt_length, prompt_lengths
from areal_like.data.sft import build_sft_batch
from areal_like.utils.metrics_logger import read_jsonl

# servers and torchrun jobs of its own only (no session fleet): beside the serial lane
pytestmark = [pytest.mark.beside_serial]

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
LIBRARY_BARS = ("Writing model shards", "Loading weights", "Map:", "Generating train split")


def _sft(model_dir: Path, log_dir: Path, steps: int, *extra: str) -> str:
    args = [f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"total_train_steps={steps}", "train_dataset.size=512", "train_dataset.batch_size=16",
            "valid_dataset.size=32", "evaluation.n_prompts=32", "evaluation.freq_steps=3",
            "checkpoint.freq_steps=2", "checkpoint.recover=auto", "logging.tensorboard=false",
            *extra]
    proc = subprocess.run([sys.executable, "-m", "recipes.sft", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.e2e
def test_sft_evaluates_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "sft_addition" / "trial0"
    out = _sft(tiny_model_dir, tmp_path, 4)
    for bar in LIBRARY_BARS:
        assert bar not in out, f"a library progress bar ({bar!r}) reached the output"
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3, 4]  # freq 3 + last
    assert records[0]["data/train_long_prompts_dropped"] == 0
    assert "timeperf/startup" in records[0] and "timeperf/step" not in records[0]
    assert all("timeperf/step" in r for r in records[1:])
    # off a terminal: progress as plain lines, none redrawn with a carriage return
    assert "\r" not in out and "sft steps: 4/4 (100%)" in out
    assert f"final model: {run_dir / 'final'}" in out and (run_dir / "final/config.json").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step3"  # steps 1, 3 (freq 2)

    _sft(tiny_model_dir, tmp_path, 6)  # the same run, longer: resumes after step 3
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3, 4, 6]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step5"


@pytest.mark.e2e
def test_sft_with_every_prompt_too_long_fails_naming_the_key(tiny_model_dir, tmp_path):
    # 3-digit addition prompts are 20 tokens with the chat template
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.sft", f"model.path={tiny_model_dir}",
         f"logging.log_dir={tmp_path}", "train_dataset.task_kwargs.num_digits=3", "train_dataset.size=64",
         "train_dataset.max_prompt_len=19"], cwd=REPO, env=ENV, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode != 0
    assert ("train_dataset: 64 of 64 prompts are longer than train_dataset.max_prompt_len=19 "
            "tokens (the longest, row 0, has 20): nothing is left to train on") in proc.stderr


def _messages(lengths: list[int]) -> Dataset:
    return Dataset.from_list([{"id": i, "messages": [{"role": "user", "content": "x" * n}]}
                              for i, n in enumerate(lengths)])


def test_long_prompts_are_dropped_and_counted_or_an_error(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = _messages([1, 40, 2, 80, 3])
    base = prompt_lengths(_messages([0]), tokenizer)[0]  # the chat template's own tokens
    measured = prompt_lengths(data, tokenizer)
    limit = max(measured[0], measured[2], measured[4])
    assert measured[1] > limit and measured[3] > limit and measured[0] > base
    kept, dropped = limit_prompt_length(data, tokenizer, DatasetConfig(max_prompt_len=limit),
                                        "train_dataset")
    assert dropped == 2 and kept["id"] == [0, 2, 4]
    with pytest.raises(ValueError, match=r"train_dataset: 2 of 5 prompts are longer than "
                                         rf"train_dataset.max_prompt_len={limit} tokens "
                                         rf"\(the longest, row 3, has {measured[3]}\)"):
        limit_prompt_length(data, tokenizer,
                            DatasetConfig(max_prompt_len=limit, on_long_prompt="error"),
                            "train_dataset")


def test_sft_teaches_an_items_target_and_eos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    items = make_addition_items(2, 400, "train", seed=1, worked_fraction=0.5)
    worked = next(i for i in items if i["target"] != i["answer"])
    plain = next(i for i in items if i["target"] == i["answer"])
    batch = build_sft_batch([worked, plain], tokenizer)
    for row, item in enumerate((worked, plain)):
        ids = batch["input_ids"][row][batch["loss_mask"][row]].tolist()
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[:-1]) == item["target"]
    assert "####" in worked["target"]


def test_loader_resumes_after_the_batches_already_drawn():
    loader = ItemLoader([{"i": i} for i in range(10)], batch_size=3, seed=4)
    straight = loader.forever()
    expected = [next(straight) for _ in range(8)]  # 3 batches per epoch: crosses 2 epochs
    for skip in (0, 2, 3, 7):
        resumed = ItemLoader([{"i": i} for i in range(10)], batch_size=3, seed=4).forever(
            skip=skip)
        assert [next(resumed) for _ in range(8 - skip)] == expected[skip:]
