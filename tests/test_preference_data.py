"""Preference pairs where they enter: JSONL files and dataset folders read through HF `datasets`,
the chat and conversational formats, and every refusal naming the file and line (or row);
reward-model folders whose head does not match refused naming the head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoConfig, AutoTokenizer

from areal_like.api.preference_config import PreferenceDataConfig
from areal_like.data.preference import (
    PreferenceDataError,
    addition_pair_rows,
    build_pair_batch,
    context_limit,
    load_pairs,
)
from areal_like.rewards.rm_model import check_reward_model_folder

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _jsonl(path: Path, rows: list, blank_after_first: bool = True) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_after_first:
        lines.insert(1, "")  # a blank line holds no row: line numbers still count it
    path.write_text("\n".join(lines) + "\n")
    return path


def _load(tiny_model_dir: Path, path: Path, add_eos: bool = False, **kw):  # noqa: ANN202
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = PreferenceDataConfig(type="file", path=str(path), size=0, **kw)
    return load_pairs(config, tokenizer, AutoConfig.from_pretrained(tiny_model_dir), "pairs",
                      add_eos)


def test_jsonl_pairs_in_every_format_load_and_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6", "margin": 2},
            {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "5"}],
             "rejected": [{"role": "assistant", "content": "7"}]}]
    pairs = _load(tiny_model_dir, _jsonl(tmp_path / "p.jsonl", rows), add_eos=True)
    assert [p.source for p in pairs] == [f"{tmp_path / 'p.jsonl'}:1", f"{tmp_path / 'p.jsonl'}:3"]
    assert pairs[0].prompt_ids == tokenizer.encode("2 + 3 =", add_special_tokens=False)
    assert pairs[0].chosen_ids == tokenizer.encode(" 5", add_special_tokens=False) + [
        tokenizer.eos_token_id]
    chat = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert pairs[1].prompt_ids == tokenizer.encode(chat, add_special_tokens=False)
    assert (pairs[0].margin, pairs[1].margin) == (2.0, 0.0)

    batch = build_pair_batch(pairs)
    assert batch["is_chosen"].tolist() == [True, False, True, False]
    assert batch["loss_group_id"].tolist() == [0, 0, 1, 1]
    row = batch["input_ids"][3][batch["attention_mask"][3].bool()].tolist()
    assert row == pairs[1].prompt_ids + pairs[1].rejected_ids
    # the loss mask covers the response (and its EOS), not the prompt
    assert int(batch["loss_mask"][3].sum()) == len(pairs[1].rejected_ids)


def test_dataset_folders_load_by_split(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"},
            {"prompt": "d", "chosen": "e", "rejected": "f"}]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}
                ).save_to_disk(str(tmp_path / "saved"))
    assert len(_load(tiny_model_dir, tmp_path / "saved", split="test")) == 1
    with pytest.raises(PreferenceDataError, match="split='valid'.*splits \\['test', 'train'\\]"):
        _load(tiny_model_dir, tmp_path / "saved", split="valid")
    hub = tmp_path / "hub" / "data"  # the Hub's layout: split files under data/
    hub.mkdir(parents=True)
    _jsonl(hub / "train.jsonl", rows, blank_after_first=False)
    _jsonl(hub / "test.jsonl", rows[:1], blank_after_first=False)
    assert len(_load(tiny_model_dir, tmp_path / "hub", split="train")) == 2


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "p", "chosen": "  ", "rejected": "x"}, "'chosen' is empty"),
    ({"prompt": "p", "chosen": "x", "rejected": ""}, "'rejected' is empty"),
    ({"prompt": "p", "chosen": "x"}, "missing \\['rejected'\\]"),
    ({"prompt": 3, "chosen": "x", "rejected": "y"}, "'prompt' must be a string or a list"),
    ({"prompt": "p", "chosen": "x", "rejected": "y", "margin": "big"}, "'margin' must be a finite"),
    ({"prompt": "p " * 40, "chosen": "x", "rejected": "y"},
     "tokens \\(prompt \\+ longest response\\) exceed the limit of 32"),
], ids=["identical", "empty_chosen", "empty_rejected", "missing", "prompt_type", "margin",
        "too_long"])
def test_a_bad_pair_is_refused_naming_its_file_and_line(tiny_model_dir: Path, tmp_path: Path,
                                                        bad: dict, message: str) -> None:
    good = {"prompt": "p", "chosen": "x", "rejected": "y"}
    path = _jsonl(tmp_path / "pairs.jsonl", [good, good, bad])
    with pytest.raises(PreferenceDataError, match=message) as info:
        _load(tiny_model_dir, path, max_length=32)
    assert f"pairs {path}:4:" in str(info.value)  # line 4: line 2 is blank


def test_files_without_the_pair_columns_or_json_are_named(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    Dataset.from_list([{"question": "q", "answer": "a"}]).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(PreferenceDataError, match="no column\\(s\\) \\['prompt', 'chosen', "
                                                  "'rejected'\\]"):
        _load(tiny_model_dir, tmp_path / "p.parquet")
    (tmp_path / "p.jsonl").write_text('{"prompt": "p", "chosen": "x", "rejected": "y"}\n{"prompt": \n')
    with pytest.raises(PreferenceDataError, match=f"pairs {tmp_path / 'p.jsonl'}:2: not JSON"):
        _load(tiny_model_dir, tmp_path / "p.jsonl")


def test_the_model_context_bounds_a_pair(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.max_position_embeddings = 24
    assert context_limit(PreferenceDataConfig(max_length=512), config) == 24
    assert context_limit(PreferenceDataConfig(max_length=16), config) == 16


def test_generated_addition_pairs_prefer_the_right_sum() -> None:
    rows = addition_pair_rows(2, 200, "train", seed=3)
    for row in rows:
        a, b = map(int, row["prompt"][0]["content"][8:-1].split(" + "))
        assert row["chosen"] == str(a + b) and row["rejected"] != row["chosen"]
        assert int(row["rejected"]) >= 0
    assert rows == addition_pair_rows(2, 200, "train", seed=3)  # seeded
    test_prompts = {r["prompt"][0]["content"] for r in addition_pair_rows(2, 200, "test", 3)}
    assert not test_prompts & {r["prompt"][0]["content"] for r in rows}  # the task's split


def test_a_folder_without_a_reward_head_is_refused_naming_its_head(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ForCausalLM'\\], num_labels=.* \\(a causal LM: a "
                                         "policy, not a reward model\\)"):
        check_reward_model_folder(str(tiny_model_dir))
    two = tmp_path / "two_labels"
    two.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(architectures=["Qwen2ForSequenceClassification"],
                  id2label={"0": "bad", "1": "good"})
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_labels=2; a reward model has a one-output"):
        check_reward_model_folder(str(two))


def test_the_dpo_recipes_preflight_refuses_a_bad_pair_file(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    """The check `areal-like run dpo` runs before anything starts (the rm recipe's, through
    the launcher: below); DPO's responses carry EOS."""
    from areal_like.api.config_loader import ConfigError, load_config
    from areal_like.runtime.preflight import check_recipe_config
    from recipes.configs import DPOConfig

    path = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p " * 30, "chosen": "x", "rejected": "y"}])
    overrides = [f"model.path={tiny_model_dir}", "pairs.type=file", f"pairs.path={path}"]
    config = load_config(DPOConfig, REPO / "recipes/conf/dpo_addition.yaml", overrides)
    check_recipe_config(config)  # fits the default max_length
    config.pairs.max_length = 32
    with pytest.raises(ConfigError, match=f"pairs {path}:1: .* tokens \\(prompt \\+ longest "
                                          "response \\+ EOS\\) exceed the limit of 32"):
        check_recipe_config(config)


def test_a_bad_pair_file_fails_before_training_naming_its_line(tiny_model_dir, tmp_path):
    # (through the launcher, as a user starts it; it fails in its preflight, in seconds)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"}\n'
                     '{"prompt": "2 + 2 =", "chosen": "4", "rejected": "4"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "rm", f"model.path={tiny_model_dir}",
         f"logging.log_dir={tmp_path}", "pairs.type=file", f"pairs.path={pairs}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert (f"pairs (type=file): pairs {pairs}:2: 'chosen' and 'rejected' are identical"
            in proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*/trial0/metrics.jsonl"))  # nothing started
