"""Tasks and rewards: determinism, splits, loaders and verifier correctness."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from areal_like.api.config import DatasetConfig, RewardConfig
from areal_like.data.addition import load_addition, worked_addition
from areal_like.data.gsm8k import load_gsm8k
from areal_like.data.reasoning_gym_tasks import load_reasoning_gym
from areal_like.data.tasks import build_task
from areal_like.rewards import (
    exact_match_reward,
    extract_final_answer,
    math_verify_reward,
    reasoning_gym_reward,
)


def test_addition_is_deterministic_correct_and_split():
    a = load_addition(2, 300, "train", seed=5)
    assert a.to_list() == load_addition(2, 300, "train", seed=5).to_list()
    assert a["question"] != load_addition(2, 300, "train", seed=6)["question"]
    test = load_addition(2, 300, "test", seed=5)
    assert not set(a["question"]) & set(test["question"])
    assert len(set(a["question"])) == 300
    for row in a:
        x, y = (int(t) for t in row["question"].removeprefix("What is ").rstrip("?").split(" + "))
        assert 10 <= x <= 99 and 10 <= y <= 99
        assert row["answer"] == str(x + y)
        assert row["messages"] == [{"role": "user", "content": row["question"]}]


def test_addition_worked_targets_are_a_hashed_share_and_verify():
    plain = load_addition(2, 2000, "train", seed=3)
    mixed = load_addition(2, 2000, "train", seed=3, worked_fraction=0.25)
    assert plain["question"] == mixed["question"]  # the share changes targets, not problems
    assert plain["target"] == plain["answer"]
    worked = [row for row in mixed if row["target"] != row["answer"]]
    assert 0.2 < len(worked) / len(mixed) < 0.3
    for row in worked:
        x, y = (int(t) for t in row["question"].removeprefix("What is ").rstrip("?").split(" + "))
        assert row["target"].startswith(f"{x} + {y}: ")
        assert exact_match_reward("", row["target"], row["answer"]) == 1.0
        # the columns, least significant first, are the schoolbook sums with carries
        columns = row["target"].split(": ", 1)[1].split(" #### ")[0].split("; ")
        assert int(columns[0].split(" = ")[1].split(",")[0]) == x % 10 + y % 10
    assert worked_addition(99, 99) == ("99 + 99: 9 + 9 = 18, write 8, carry 1; "
                                       "9 + 9 + 1 = 19, write 19 #### 198")
    assert worked_addition(5, 7) == "5 + 7: 5 + 7 = 12, write 12 #### 12"


def test_addition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split='val'"):
        load_addition(2, 10, "val")
    with pytest.raises(ValueError, match="too large"):
        load_addition(1, 1000, "train")
    with pytest.raises(ValueError, match="worked_fraction=1.5"):
        load_addition(2, 10, "train", worked_fraction=1.5)
    with pytest.raises(ValueError, match=r"DatasetConfig.task_kwargs.worked_fraction=-0.1"):
        DatasetConfig(task_kwargs={"worked_fraction": -0.1})


@pytest.mark.parametrize("completion, reward", [
    ("105", 1.0), (" 105\n", 1.0), ("<answer>105</answer>", 1.0), ("so #### 105", 1.0),
    ("104", 0.0), ("1050", 0.0), ("", 0.0), ("one hundred five", 0.0), ("105 + 1", 0.0),
])
def test_exact_match_reward(completion, reward):
    assert exact_match_reward("What is 28 + 77?", completion, answer="105") == reward


def test_extract_final_answer_priority():
    assert extract_final_answer("x <answer>1</answer> #### 2 <answer> 3 </answer>") == "3"
    assert extract_final_answer("work #### 2") == "2"


def _write_gsm8k(tmp_path, rows, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    return path


GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A shop sells 1,200 pens.", "answer": "So 1,200.\n#### 1,200"},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_loader(tmp_path, suffix):
    ds = load_gsm8k(_write_gsm8k(tmp_path, GSM_ROWS, suffix))
    assert ds["answer"] == ["7", "1200"]
    assert ds[0]["solution"] == GSM_ROWS[0]["answer"]
    assert ds[1]["messages"][0]["content"] == GSM_ROWS[1]["question"]


def test_gsm8k_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gsm8k(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_gsm8k(tmp_path / "x.csv")
    bad = _write_gsm8k(tmp_path, [{"question": "q", "answer": "no marker"}], ".jsonl")
    with pytest.raises(ValueError, match=r"data.jsonl:1: key .answer.*####"):
        load_gsm8k(bad)
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text(json.dumps({"prompt": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="question"):
        load_gsm8k(nocol)


@pytest.mark.parametrize("completion, answer, reward", [
    ("The answer is \\boxed{7}", "7", 1.0),
    ("#### 1,200", "1200", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{8}", "7", 0.0),
    ("no number here", "7", 0.0),
    ("", "7", 0.0),
])
def test_math_verify_reward(completion, answer, reward):
    assert math_verify_reward("q", completion, answer=answer) == reward


def test_math_verify_reward_rejects_unparseable_reference():
    with pytest.raises(ValueError, match="reference answer"):
        math_verify_reward("q", "\\boxed{1}", answer="")


def test_reasoning_gym_adapter_and_reward():
    ds = load_reasoning_gym("basic_arithmetic", size=5, seed=3)
    assert ds.to_list() == load_reasoning_gym("basic_arithmetic", size=5, seed=3).to_list()
    for row in ds:
        assert reasoning_gym_reward(row["question"], row["answer"], **row) == 1.0
        assert reasoning_gym_reward(row["question"], "<answer>garbage</answer>", **row) == 0.0
    with pytest.raises(KeyError, match="did you mean"):
        load_reasoning_gym("basic_arithmetc", size=1)


def test_build_task_dispatches_by_type(tmp_path):
    task = build_task(DatasetConfig(type="addition", size=4, task_kwargs={"num_digits": 3},
                                    seed=2))
    assert len(task.dataset) == 4 and task.reward_fn is exact_match_reward
    row = task.dataset[0]
    assert task.reward_fn(row["question"], row["answer"], **row) == 1.0
    rg = build_task(DatasetConfig(type="reasoning_gym:basic_arithmetic", size=2, split="test"))
    assert rg.reward_fn is reasoning_gym_reward
    with pytest.raises(ValueError, match="path"):
        build_task(DatasetConfig(type="gsm8k"))
    with pytest.raises(ValueError, match="DatasetConfig.type"):
        DatasetConfig(type="mnist")


def test_reasoning_gym_task_kwargs_reach_the_generator_and_bad_ones_are_named():
    easy = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
            "allow_negation": False}
    task = build_task(DatasetConfig(type="reasoning_gym:basic_arithmetic", size=20,
                                    task_kwargs=easy))
    for row in task.dataset:  # "Calculate 3 + -4." and the like: two one-digit terms
        terms = re.findall(r"-?\d+", row["question"])
        assert len(terms) == 2 and all(len(t.lstrip("-")) == 1 for t in terms), row["question"]
        assert int(row["answer"]) == sum(int(t) for t in terms)
    with pytest.raises(ValueError, match=r"no parameter 'num_terms' \(did you mean 'min_terms'"
                                         r"\?\).*its parameters: \['min_terms'"):
        build_task(DatasetConfig(type="reasoning_gym:basic_arithmetic", size=2,
                                 task_kwargs={"num_terms": 2}))
    with pytest.raises(ValueError, match="rejected task_kwargs .*max_terms must be >= min_terms"):
        build_task(DatasetConfig(type="reasoning_gym:basic_arithmetic", size=2,
                                 task_kwargs={"min_terms": 5, "max_terms": 2}))
    with pytest.raises(ValueError, match=r"task_kwargs.*'addition': \['num_digits', "
                                         r"'worked_fraction'\] \(not \['num_terms'\]\)"):
        DatasetConfig(type="addition", task_kwargs={"num_terms": 2})
    three = build_task(DatasetConfig(type="addition", size=5, task_kwargs={"num_digits": 3}))
    assert all(len(q) for q in three.dataset["question"])
    assert all(re.search(r"\b\d{3} \+ \d{3}\b", q) for q in three.dataset["question"])


@pytest.mark.parametrize("task_type,kwargs", [
    ("addition", {}),
    ("reasoning_gym:basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 2}),
    ("reasoning_gym:leg_counting", {}),
    ("memory_agent", {}),
])
def test_held_out_split_is_disjoint_from_training(task_type, kwargs):
    """Whatever the seeds and sizes: every question belongs to one split (for the memory agent,
    a question is the set of facts asked about, whatever the chatter around them)."""
    def questions(split, size, seed):
        rows = build_task(DatasetConfig(type=task_type, size=size, seed=seed, split=split,
                                        task_kwargs=kwargs)).dataset
        if task_type == "memory_agent":
            return [repr((r["questions"], r["answers"])) for r in rows]
        return rows["question"]
    train_q = questions("train", 600, 1)
    test_q, other_test_q = questions("test", 60, 1), questions("test", 60, 7)
    assert len(set(train_q)) == 600 and len(set(test_q)) == 60  # distinct
    assert not set(train_q) & set(test_q)
    assert not set(train_q) & set(other_test_q)


def test_own_task_and_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "user_tasks_mod.py").write_text(
        "def make(split, size, seed, start=0):\n"
        "    return [{'messages': [{'role': 'user', 'content': f'{split} {i}'}], 'answer': str(i)}"
        "\n            for i in range(start, start + size)]\n"
        "def score(prompt, completion, answer, **_):\n    return float(completion == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(DatasetConfig(type="user_tasks_mod:make", size=3, split="test",
                                    task_kwargs={"start": 5}), "user_tasks_mod:score")
    assert task.dataset["answer"] == ["5", "6", "7"]
    assert task.reward_fn("p", "6", answer="6") == 1.0
    with pytest.raises(RuntimeError, match="set reward.fn"):  # a Dataset brings no verifier
        build_task(DatasetConfig(type="user_tasks_mod:make", size=1)).reward_fn("p", "c")
    with pytest.raises(ImportError, match=r"train_dataset.type / valid_dataset.type="
                                          r"'no_such_mod:make' cannot be imported in the "
                                          r"process MainProcess \(pid \d+"):
        build_task(DatasetConfig(type="no_such_mod:make", size=1))
    with pytest.raises(ImportError, match=r"reward.fn='user_tasks_mod:scor' cannot be imported"):
        build_task(DatasetConfig(type="addition", size=1), "user_tasks_mod:scor")
    with pytest.raises(ValueError, match="RewardConfig.fn='score' is invalid"):
        RewardConfig(fn="score")
