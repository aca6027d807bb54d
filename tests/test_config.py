"""Config composition with Hydra and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_like.api.config import BaseExperimentConfig, OptimizerConfig
from areal_like.api.config_loader import ConfigError, load_config, register_schema, to_yaml
from areal_like.api.rollout_config import ROLLOUT_MOVED_KEYS

register_schema("test_base_schema", BaseExperimentConfig)

YAML = """\
defaults:
  - test_base_schema
  - _self_
seed: 7
actor:
  optimizer:
    lr: 1.0e-4
    lr_scheduler_type: cosine
rollout:
  server_addrs: ["127.0.0.1:30000"]
"""


@pytest.fixture()
def conf(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(YAML)
    return path


def test_yaml_and_overrides_compose_into_validated_dataclass(conf):
    cfg = load_config(BaseExperimentConfig, conf, [
        "actor.optimizer.lr=2e-5", "rollout.staleness.max_head_offpolicyness=4",
        "rollout.server_addrs=[10.0.0.1:1,10.0.0.2:2]", "gconfig.stop_token_ids=[2,5]",
    ])
    assert isinstance(cfg, BaseExperimentConfig)
    assert isinstance(cfg.actor.optimizer, OptimizerConfig)
    assert cfg.seed == 7
    assert cfg.actor.optimizer.lr == pytest.approx(2e-5)
    assert cfg.actor.optimizer.lr_scheduler_type == "cosine"
    assert cfg.rollout.staleness.max_head_offpolicyness == 4
    assert cfg.rollout.server_addrs == ["10.0.0.1:1", "10.0.0.2:2"]
    assert cfg.gconfig.stop_token_ids == [2, 5]
    # defaults from the dataclass fill what the YAML does not state
    assert cfg.rollout.staleness.consumer_batch_size == BaseExperimentConfig().rollout.staleness.consumer_batch_size
    assert "lr: 2.0e-05" in to_yaml(cfg)


def test_override_typo_names_key_and_closest(conf):
    with pytest.raises(ConfigError, match=r"'actor\.optimizer\.lrr'.*did you mean 'actor\.optimizer\.lr'"):
        load_config(BaseExperimentConfig, conf, ["actor.optimizer.lrr=1e-5"])
    with pytest.raises(ConfigError, match=r"'actor\.optimzer'.*did you mean 'actor\.optimizer'"):
        load_config(BaseExperimentConfig, conf, ["actor.optimzer.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"'sed'.*did you mean 'seed'"):
        load_config(BaseExperimentConfig, conf, ["sed=3"])


def test_typo_hint_offers_only_keys_of_the_sections_task_type():
    """A reasoning-gym task is offered its own generator parameters, addition its own; a
    parameter written where a field goes is pointed to task_kwargs; gsm8k's `path` set for
    another task is an error, not silently ignored."""
    import recipes  # noqa: F401 - registers the shipped schemas and config folder
    from recipes.grpo import GRPOConfig
    shipped = Path(recipes.__file__).parent / "conf" / "grpo_addition.yaml"
    gym = "train_dataset.type=reasoning_gym:basic_arithmetic"
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, shipped, [gym, "train_dataset.num_terms=2"])
    assert "did you mean 'train_dataset.task_kwargs.min_terms' or " \
           "'train_dataset.task_kwargs.max_terms'?" in str(e.value)
    assert "num_digits" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'train_dataset.task_kwargs.num_digits'"):
        load_config(GRPOConfig, shipped, ["train_dataset.num_digits=3"])  # type: addition
    with pytest.raises(ConfigError, match=r"path='/a.jsonl' is invalid: expected unset: only "
                                          r"type=gsm8k reads a file, not 'reasoning_gym"):
        load_config(GRPOConfig, shipped, [gym, "train_dataset.path=/a.jsonl"])


INHERITED = """defaults:
  - {parent}
  - _self_
train_dataset:
  type: reasoning_gym:chain_sum
  task_kwargs: {{min_terms: 2}}
"""


def test_a_config_changing_a_dataset_type_drops_the_old_tasks_keys(tmp_path, capfd):
    """Item 4 of the first-hour issue: keys of the extended config's task do not follow into
    another task type (each drop is named once); keys set again after the change stay."""
    import recipes  # noqa: F401
    from areal_like.api.config_loader import to_yaml
    from recipes.configs import SFTConfig
    (tmp_path / "parent.yaml").write_text(
        "defaults: [sft_addition, _self_]\ntrain_dataset:\n  task_kwargs: {worked_fraction: 0.5,"
        " num_digits: 3}\nvalid_dataset:\n  task_kwargs: {num_digits: 3}\n")
    child = tmp_path / "child.yaml"
    child.write_text(INHERITED.format(parent="parent"))
    config = load_config(SFTConfig, child)
    assert config.train_dataset.task_kwargs == {"min_terms": 2}
    assert config.valid_dataset.task_kwargs == {"num_digits": 3}  # its type did not change
    assert "num_digits" not in to_yaml(config).split("valid_dataset:")[0]
    err = capfd.readouterr().err
    assert err.count("dropped") == 2, err
    assert ("train_dataset.type is 'reasoning_gym:chain_sum', so train_dataset.task_kwargs."
            "num_digits (set by parent.yaml for type 'addition') is dropped") in err
    # a launcher reading the same file says it once too (it composes twice)
    from areal_like.api.config import BaseExperimentConfig
    from areal_like.api.config_loader import load_launch_config
    launched = load_launch_config(BaseExperimentConfig, child)
    assert launched.train_dataset.task_kwargs == {"min_terms": 2}
    assert capfd.readouterr().err.count("dropped") == 2
    # a command-line change of type drops the file's keys; a key given again is kept
    config = load_config(SFTConfig, tmp_path / "parent.yaml", [
        "valid_dataset.type=reasoning_gym:chain_sum", "train_dataset.type=my_mod:make",
        "train_dataset.task_kwargs.num_digits=4"])
    assert config.valid_dataset.task_kwargs == {}
    assert config.train_dataset.task_kwargs == {"num_digits": 4}
    # a file that changes the type back, then sets its own keys: only those
    child.write_text(INHERITED.format(parent="child_mid"))
    (tmp_path / "child_mid.yaml").write_text(
        "defaults: [parent, _self_]\ntrain_dataset:\n  type: gsm8k\n  path: /x.jsonl\n")
    config = load_config(SFTConfig, child)
    assert config.train_dataset.task_kwargs == {"min_terms": 2} and config.train_dataset.path == ""


def test_yaml_typo_names_key_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(YAML.replace("lr_scheduler_type", "lr_schedular_type"))
    with pytest.raises(ConfigError, match=r"bad\.yaml.*'actor\.optimizer\.lr_schedular_type'.*"
                                          r"did you mean 'actor\.optimizer\.lr_scheduler_type'"):
        load_config(BaseExperimentConfig, path)


def test_wrong_type_names_key(conf):
    with pytest.raises(ConfigError, match=r"bad value for config key 'rollout\.staleness\.consumer_batch_size'"):
        load_config(BaseExperimentConfig, conf, ["rollout.staleness.consumer_batch_size=many"])


def test_invalid_value_names_key(conf):
    with pytest.raises(ConfigError, match=r"max_head_offpolicyness=-1"):
        load_config(BaseExperimentConfig, conf, ["rollout.staleness.max_head_offpolicyness=-1"])
    with pytest.raises(ConfigError, match=r"lr_scheduler_type='exp'"):
        load_config(BaseExperimentConfig, conf, ["actor.optimizer.lr_scheduler_type=exp"])
    with pytest.raises(ConfigError, match=r"server_addrs='nohost'"):
        load_config(BaseExperimentConfig, conf, ["rollout.server_addrs=[nohost]"])


def test_missing_file_and_missing_schema(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(BaseExperimentConfig, tmp_path / "nope.yaml")
    plain = tmp_path / "plain.yaml"
    plain.write_text("seed: 3\n")
    with pytest.raises(ConfigError, match="defaults list"):
        load_config(BaseExperimentConfig, plain)


def test_shipped_recipe_configs_compose():
    from recipes.configs import RECIPES

    conf = Path(__file__).resolve().parents[1] / "recipes" / "conf"
    for name, (cls, yaml_name, _) in RECIPES.items():
        cfg = load_config(cls, conf / yaml_name)
        assert isinstance(cfg, cls), name
    from recipes.configs import GRPOConfig

    gsm = load_config(GRPOConfig, conf / "gsm8k_grpo.yaml",
                      ["model.path=/m", "train_dataset.path=/a.jsonl", "valid_dataset.path=/b.jsonl"])
    assert gsm.actor.model.path == "/m" and gsm.server.device == "cuda"


def test_a_yaml_anywhere_extends_the_shipped_configs(tmp_path):
    """The shipped config folder is on every composition's search path."""
    from areal_like.runtime.recipe_args import split_args
    from recipes.configs import GRPOConfig

    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - grpo_addition\n  - _self_\ntotal_train_steps: 7\nactor:\n"
        "  optimizer:\n    lr: 3.0e-4\n")
    shipped = load_config(GRPOConfig, Path("recipes/conf/grpo_addition.yaml").resolve())
    for argv in (["--config", str(tmp_path / "mine.yaml")],
                 ["--config-path", str(tmp_path), "--config-name", "mine"],
                 [f"-cp={tmp_path}", "-cn=mine.yaml"]):
        path, overrides = split_args([*argv, "seed=5"], "grpo_addition.yaml")
        mine = load_config(GRPOConfig, path, overrides)
        assert (mine.total_train_steps, mine.actor.optimizer.lr, mine.seed) == (7, 3e-4, 5)
        # everything else is the shipped recipe's (which itself extends addition_common)
        assert mine.evaluation == shipped.evaluation and mine.algorithm == shipped.algorithm
        assert mine.train_dataset == shipped.train_dataset


def test_a_defaults_entry_not_found_names_the_files_looked_for(tmp_path):
    from recipes.configs import GRPOConfig

    (tmp_path / "mine.yaml").write_text("defaults:\n  - grpo_addtion\n  - _self_\n")
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, tmp_path / "mine.yaml")
    message = str(err.value)
    assert f"{tmp_path / 'grpo_addtion.yaml'} or " in message
    assert str(Path("recipes/conf/grpo_addtion.yaml").resolve()) in message
    assert "did you mean 'grpo_addition'?" in message


@pytest.mark.parametrize("argv,message", [
    (["--config-path", "/d"], "--config-path needs --config-name"),
    (["--config", "a.yaml", "-cn", "b"], "either --config FILE or --config-path"),
    (["--config-name"], "--config-name needs a value"),
    (["--cfg", "x"], "unknown option '--cfg'"),
])
def test_bad_config_options_are_named(argv, message):
    from areal_like.runtime.recipe_args import split_args

    with pytest.raises(ConfigError, match=message):
        split_args(argv, "grpo_addition.yaml")


REPO = Path(__file__).resolve().parents[1]
_THREADS = """
import os, sys
import torch
from areal_like.runtime.recipe_args import parse_recipe_args
from recipes.configs import GRPOConfig
parse_recipe_args(GRPOConfig, "grpo_addition.yaml", sys.argv[1:])
print(torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])
"""


@pytest.mark.parametrize("env_threads,overrides,expected", [
    (None, [], "1 1"),  # nothing set: one thread, for this process and those it starts
    (None, ["launcher.threads_per_trainer=2"], "2 2"),
    ("2", [], "2 2"),  # the user's (or a launcher's) setting stands
])
def test_a_recipe_run_by_hand_uses_the_launchers_threads(env_threads, overrides, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if env_threads:
        env["OMP_NUM_THREADS"] = env_threads
    proc = subprocess.run([sys.executable, "-c", _THREADS, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == expected


@pytest.mark.parametrize("old", sorted(ROLLOUT_MOVED_KEYS))
def test_an_old_flat_rollout_key_names_its_new_place(conf, tmp_path, old):
    """Each of the 24 keys `rollout` had before it nested by concern, as an override and in a
    YAML file: refused naming its new place (nothing silently ignored)."""
    new = f"rollout.{ROLLOUT_MOVED_KEYS[old]}"
    with pytest.raises(ConfigError, match=f"'rollout.{old}' is now '{new}'"):
        load_config(BaseExperimentConfig, conf, [f"rollout.{old}=1"])
    path = tmp_path / "old.yaml"
    path.write_text(YAML + f"  {old}: 1\n")
    with pytest.raises(ConfigError, match=f"'rollout.{old}' is now '{new}'"):
        load_config(BaseExperimentConfig, path)


def test_a_nested_rollout_section_composes_and_checks_its_bounds(conf):
    config = load_config(BaseExperimentConfig, conf, [
        "rollout.staleness.max_head_offpolicyness=3", "rollout.weights.transport=distributed",
        "rollout.client.request_retries=5", "rollout.health.check_interval=0.5",
        "rollout.controller.cpus=[0]"])
    rollout = config.rollout
    assert (rollout.staleness.max_head_offpolicyness, rollout.weights.transport,
            rollout.client.request_retries, rollout.health.check_interval,
            rollout.controller.cpus) == (3, "distributed", 5, 0.5, [0])
    assert rollout.staleness.consumer_batch_size == 8  # the rest keep their defaults
    with pytest.raises(ConfigError, match=r"rollout\.client\.request_retries=0 is invalid: "
                                          r"expected >= 1"):
        load_config(BaseExperimentConfig, conf, ["rollout.client.request_retries=0"])
    with pytest.raises(ConfigError, match=r"rollout\.controller\.nice=20 is invalid: "
                                          r"expected in 0\.\.19"):
        load_config(BaseExperimentConfig, conf, ["rollout.controller.nice=20"])


def test_an_old_top_level_agent_key_names_its_section():
    from recipes.configs import AgentConfig

    conf_dir = Path(__file__).resolve().parents[1] / "recipes" / "conf"
    with pytest.raises(ConfigError, match="'answerer' is now 'agent.answerer'"):
        load_config(AgentConfig, conf_dir / "agent_memory.yaml", ["answerer=policy"])
    config = load_config(AgentConfig, conf_dir / "agent_memory.yaml", ["agent.answerer=policy"])
    assert config.agent.answerer == "policy" and config.agent.max_steps == 1
    with pytest.raises(ConfigError, match=r"agent\.answerer='oracle' is invalid"):
        load_config(AgentConfig, conf_dir / "agent_memory.yaml", ["agent.answerer=oracle"])
