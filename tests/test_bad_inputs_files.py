"""Bad config files, and task sizes a task cannot give, are refused before anything starts.

A YAML with a tab, a key given twice (in the file or in a file its defaults list names), a top
level that is not a mapping, an empty or non-UTF-8 file: `config error: <file>:<line>:<col>:
<what>`, exit code 2, no traceback and no process started, through the launcher, `areal-like
run`, a recipe run by hand (`parse_recipe_args`) and `areal-like eval`. A reasoning-gym size
past what the task can give is refused once no new question comes (not after 50 draws per
item). `areal-like eval` finds the schema a recipe YAML's defaults list names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
HEAD = "defaults:\n  - grpo_schema\n  - _self_\n"
WITH_COMMON = "defaults:\n  - grpo_schema\n  - common\n  - _self_\nseed: 1\n"

# (id, {file name: text or bytes} with the YAML given first, message with {dir} for the folder)
YAML_CASES = [
    ("tab", {"bad.yaml": HEAD + "seed: 1\nactor:\n\toptimizer: {lr: 1.0e-4}\n"},
     "{dir}/bad.yaml:6:1: a tab character cannot indent YAML (indent with spaces)"),
    ("tab-separator", {"bad.yaml": HEAD + "seed:\t1\n"},
     "{dir}/bad.yaml:4:6: a tab character cannot separate YAML tokens (use a space)"),
    ("duplicate", {"bad.yaml": HEAD + "seed: 1\ntotal_train_steps: 3\nseed: 2\n"},
     "{dir}/bad.yaml:6:1: duplicate key 'seed' (first set at line 4)"),
    ("duplicate-nested", {"bad.yaml": HEAD + "actor:\n  optimizer:\n    lr: 1.0e-4\n"
                                             "    lr: 2.0e-4\n"},
     "{dir}/bad.yaml:7:5: duplicate key 'lr' (first set at line 6)"),
    ("duplicate-included", {"bad.yaml": WITH_COMMON,
                            "common.yaml": "seed: 1\ntotal_train_steps: 3\nseed: 2\n"},
     "{dir}/common.yaml:3:1: duplicate key 'seed' (first set at line 1) (a file the defaults "
     "list of {dir}/bad.yaml names)"),
    ("tab-included", {"bad.yaml": WITH_COMMON, "common.yaml": "gconfig:\n\tn_samples: 4\n"},
     "{dir}/common.yaml:2:1: a tab character cannot indent YAML (indent with spaces) (a file "
     "the defaults list of {dir}/bad.yaml names)"),
    ("list", {"bad.yaml": "# a list, not a mapping\n- grpo_schema\n- _self_\n"},
     "{dir}/bad.yaml:2:1: a config YAML must be a mapping (`key: value` lines) at the top; "
     "this one is a list"),
    ("scalar", {"bad.yaml": "grpo_schema\n"},
     "{dir}/bad.yaml:1:1: a config YAML must be a mapping (`key: value` lines) at the top; "
     "this one is a single value ('grpo_schema')"),
    ("empty", {"bad.yaml": "# nothing yet\n"},
     "{dir}/bad.yaml: the file is empty (nothing but blanks or comments)"),
    ("not-utf8", {"bad.yaml": HEAD.encode() + b"seed: 1\nname: caf\xe9\n"},
     "{dir}/bad.yaml:5:10: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
]


def _write(folder: Path, files: dict[str, str | bytes]) -> Path:
    for name, text in files.items():
        if isinstance(text, bytes):
            (folder / name).write_bytes(text)
        else:
            (folder / name).write_text(text)
    return folder / next(iter(files))


@pytest.fixture
def no_process(monkeypatch):
    """Servers, torchrun and trainers start with subprocess.Popen: starting one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("files,message", [c[1:] for c in YAML_CASES],
                         ids=[c[0] for c in YAML_CASES])
@pytest.mark.parametrize("entry", ["launcher", "areal-like run", "areal-like eval"])
def test_a_bad_yaml_is_one_line_naming_file_line_and_column_before_any_process(
        tiny_model_dir, tmp_path, capsys, no_process, entry, files, message):
    from areal_like import cli
    from areal_like.launcher import local

    path = _write(tmp_path, files)
    args = ["--config", str(path), f"model.path={tiny_model_dir}"]
    if entry == "launcher":
        code = local.main(["grpo", *args])
    elif entry == "areal-like run":
        code = cli.main(["run", "grpo", *args])
    else:
        code = cli.main(["eval", str(tiny_model_dir), "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"config error: {message.format(dir=tmp_path)}" in err, err


@pytest.mark.parametrize("files,message", [c[1:] for c in YAML_CASES],
                         ids=[c[0] for c in YAML_CASES])
def test_a_bad_yaml_stops_a_recipe_run_by_hand_with_exit_code_2(tmp_path, capsys, files,
                                                                message):
    from areal_like.runtime.recipe_args import parse_recipe_args
    from recipes.configs import GRPOConfig

    path = _write(tmp_path, files)
    with pytest.raises(SystemExit) as e:
        parse_recipe_args(GRPOConfig, "grpo_addition.yaml", ["--config", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"config error: {message.format(dir=tmp_path)}" in err, err


def test_a_bad_yaml_prints_no_traceback(tmp_path):
    """A real `areal-like run` (a process of its own): one line on stderr, exit code 2."""
    path = _write(tmp_path, dict(YAML_CASES[0][1]))
    proc = subprocess.run([sys.executable, "-m", "areal_like.cli", "run", "grpo", "--config",
                           str(path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"config error: {path}:6:1: a tab character cannot indent "
                                   f"YAML (indent with spaces)"), proc.stderr


def test_a_good_yaml_with_merge_keys_and_an_empty_included_file_still_loads(tmp_path):
    """What the strict reading must not refuse: a mapping merged (`<<: *anchor`) and a key of
    it set again (YAML's own rule), an empty file in a defaults list (Hydra accepts it)."""
    from areal_like.api.config_loader import load_config
    from recipes.configs import GRPOConfig

    path = _write(tmp_path, {
        "good.yaml": "defaults:\n  - grpo_schema\n  - nothing\n  - _self_\n"
                     "actor: &engine\n  optimizer: {lr: 1.0e-4}\n"
                     "ref:\n  <<: *engine\n  optimizer: {lr: 2.0e-4}\n",
        "nothing.yaml": "# filled in later\n"})
    config = load_config(GRPOConfig, path)
    assert (config.actor.optimizer.lr, config.ref.optimizer.lr) == (1.0e-4, 2.0e-4)


# ---- reasoning-gym sizes a task cannot give ----------------------------------------------

CHAIN_SUM_1_DIGIT = "+train_dataset.task_kwargs={min_terms:2,max_terms:2,max_digits:1}"
RG_CASES = [
    (["train_dataset.type=reasoning_gym:chain_sum", "train_dataset.size=20000",
      CHAIN_SUM_1_DIGIT],
     ["gave only 177 distinct train questions in ", "fewer than size=20000 (no new question "
      "in the last 20000 draws: the task has 200 distinct questions of both splits): lower "
      "the size to at most 177 or widen the parameters (task_kwargs)"]),
    (["train_dataset.type=reasoning_gym:tower_of_hanoi", "train_dataset.size=10000"],
     ["reasoning-gym task 'tower_of_hanoi' with its default parameters gave only 82 distinct "
      "train questions in ", "fewer than size=10000 (no new question in the last 20000 "
      "draws: the task has 90 distinct questions of both splits)"]),
    (["valid_dataset.type=reasoning_gym:coin_flip", "valid_dataset.size=2000"],
     ["valid_dataset (type=reasoning_gym:coin_flip): reasoning-gym task 'coin_flip'",
      "distinct test questions in ", "fewer than size=2000 (no new question in the last 20000 "
      "draws"]),
]


@pytest.mark.parametrize("overrides,messages", RG_CASES,
                         ids=["chain_sum-20000", "tower_of_hanoi-10000", "coin_flip-valid-2000"])
def test_an_impossible_reasoning_gym_size_is_refused_once_no_new_question_comes(
        tiny_model_dir, capsys, no_process, overrides, messages):
    """Refused by the launcher before any process starts. Each took 0.5-1 M draws (18-25 s
    here) before; now about 21000 draws. No timing assertion: the time is printed."""
    from areal_like.launcher import local

    start = time.perf_counter()
    code = local.main(["grpo", f"model.path={tiny_model_dir}", *overrides])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    print(f"refused in {seconds:.1f} s")
    assert code == 2 and all(m in err for m in messages), err


def test_a_reasoning_gym_size_the_task_can_just_give_is_not_refused():
    """All 177 train (23 test) questions of 1-digit chain_sum, for several seeds: the stop on
    a run of draws without a new question does not cut a real size short."""
    from areal_like.data.reasoning_gym_tasks import load_reasoning_gym

    params = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    for seed in range(1, 6):
        assert len(load_reasoning_gym("chain_sum", 177, seed, "train", params)) == 177
        assert len(load_reasoning_gym("chain_sum", 23, seed, "test", params)) == 23


# ---- `areal-like eval` with a recipe's YAML ---------------------------------------------

SHIPPED = sorted(p.name for p in (ROOT / "recipes/conf").glob("*.yaml"))
NEEDS = {"gsm8k_grpo.yaml": ["train_dataset.path=train.jsonl", "valid_dataset.path=test.jsonl"]}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_yaml_gives_the_eval_command_a_config(tiny_model_dir, name):
    import recipes.configs  # noqa: F401 - what `areal-like eval` imports
    from areal_like.runtime.evaluate_model import load_eval_config

    config, path = load_eval_config(tiny_model_dir, ["--config", str(ROOT / "recipes/conf" / name),
                                                     *NEEDS.get(name, [])])
    assert config.model.path == str(tiny_model_dir) and config.rollout.server_addrs == []


def test_areal_like_eval_finds_the_schema_of_a_recipe_yaml(tiny_model_dir):
    """A process of its own (nothing registered beforehand): the config composes and the
    held-out items are built; every prompt over max_prompt_len=1 stops it, before servers."""
    proc = subprocess.run([sys.executable, "-m", "areal_like.cli", "eval", str(tiny_model_dir),
                           "--config", "recipes/conf/grpo_addition.yaml",
                           "valid_dataset.max_prompt_len=1"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(
        "config error: valid_dataset (type=addition): valid_dataset: 200 of 200 prompts are "
        "longer than valid_dataset.max_prompt_len=1 tokens"), proc.stderr
