"""Every recipe's config with each of its sections left out or set to null: the config checks
read only what is there. Left out, a section takes its defaults and the config loads or is
refused with a `ValueError` of a check (the loader's `ConfigError`), never an AttributeError
or TypeError from a check that assumed the section; null is the absence of a section where
the schema makes it optional (AReaL-lite's `ref`), and elsewhere refused naming the section.
The AReaL-lite path is covered with AReaL's own gsm8k_grpo.yaml layout
(tests/configs/arealite_gsm8k_grpo.yaml), its `ref` kept, removed and null, through the
script's loader, the launcher's loader and the pre-flight."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import recipes.configs  # noqa: F401 - registers the recipes' schemas
from areal_like.api.config import BaseExperimentConfig
from areal_like.api.config_loader import (
    ConfigError,
    _apply_algorithm_preset,
    _compose,
    _to_object,
    explain_config_error,
    load_config,
    load_launch_config,
)
from areal_like.arealite import GRPOConfig as ArealiteGRPOConfig
from areal_like.arealite import PPOConfig as ArealitePPOConfig
from areal_like.arealite import load_expr_config

REPO = Path(__file__).resolve().parents[1]
RECIPE_YAMLS = sorted((REPO / "recipes" / "conf").glob("*.yaml"))
AREAL_LAYOUT = REPO / "tests" / "configs" / "arealite_gsm8k_grpo.yaml"
GSM8K_ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
              {"question": "What is 4 + 4?", "answer": "4 + 4 = 8\n#### 8"}]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return path


def _sections(config: Any) -> list[dataclasses.Field]:
    """The fields of `config` that hold a section (a dataclass), or may (Optional[section])."""
    hints = typing.get_type_hints(type(config))
    found = []
    for f in dataclasses.fields(config):
        types = typing.get_args(hints[f.name]) or (hints[f.name],)
        if f.init and any(dataclasses.is_dataclass(t) for t in types):
            found.append(f)
    return found


def _check_every_section(config: Any, path: Path, overrides: list[str]) -> list[str]:
    """Each section of `config` (loaded from `path` with `overrides`) left out of the composed
    YAML, then null, and loaded as the loader loads a YAML (merge onto the schema, the
    algorithm preset, every __post_init__); returns what each gave."""
    schema = type(config)
    composed, source = _compose(schema, path, overrides)
    raw = OmegaConf.to_container(composed, resolve=False)
    assert isinstance(raw, dict)
    structured = OmegaConf.structured(schema)
    outcomes = []
    for f in _sections(config):
        try:  # left out: the YAML's other values, this section's defaults
            merged = OmegaConf.merge(structured, {k: v for k, v in raw.items() if k != f.name})
            _apply_algorithm_preset(merged, path, overrides, source)
            assert type(_to_object(merged, schema, source)) is schema
            outcomes.append(f"{f.name} missing: loads")
        except ConfigError as e:  # a check's refusal, which names its key
            assert re.search(r"[\w.]+=", str(e)), e
            outcomes.append(f"{f.name} missing: refused")
        with pytest.raises(OmegaConfBaseException) as info:  # null where a section must be
            OmegaConf.merge(structured, {f.name: None})
        error = str(explain_config_error(info.value, schema, source))
        assert f"config key '{f.name}' is a section" in error, error
        assert "leave it out for its defaults" in error, error
        outcomes.append(f"{f.name} null: refused")
    return outcomes


# besides every section's outcome, one each recipe must show (its own sections were tried)
EXPECTED = {"grpo_addition.yaml": "ref null: refused", "ppo_addition.yaml": "critic missing: loads",
            "distill_addition.yaml": "teacher missing: loads",
            "ppo_prm_addition.yaml": "prm null: refused", "dpo_addition.yaml": "pairs null: refused",
            "agent_memory.yaml": "agent missing: loads",
            "agent_program_calculator.yaml": "program missing: loads"}


@pytest.mark.parametrize("path", RECIPE_YAMLS, ids=[p.name for p in RECIPE_YAMLS])
def test_a_recipe_config_with_each_section_missing_or_null(path, gsm8k_file):
    overrides = ([f"train_dataset.path={gsm8k_file}", f"valid_dataset.path={gsm8k_file}"]
                 if path.name == "gsm8k_grpo.yaml" else [])
    config = load_launch_config(BaseExperimentConfig, path, overrides)  # the recipe's schema
    outcomes = _check_every_section(config, path, overrides)
    assert len(outcomes) == 2 * len(_sections(config)) >= 2 * 13, outcomes
    assert EXPECTED.get(path.name, outcomes[0]) in outcomes, outcomes


def test_a_null_section_through_the_loader_names_it():
    with pytest.raises(ConfigError, match=r"config key 'ref' is a section \(TrainEngineConfig\) "
                                          r"and cannot be null here"):
        load_config(recipes.configs.GRPOConfig, REPO / "recipes/conf/grpo_addition.yaml",
                    ["ref=null"])


def _areal_layout(tmp_path: Path, ref_form: str, **actor: Any) -> Path:
    raw = yaml.safe_load(AREAL_LAYOUT.read_text())
    raw["actor"].update(actor)
    if ref_form == "missing":
        del raw["ref"]
    elif ref_form == "null":
        raw["ref"] = None
    path = tmp_path / f"arealite_{ref_form}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("ref_form", ["full", "missing", "null"])
def test_areals_own_layout_loads_with_its_ref_full_missing_or_null(tmp_path, ref_form,
                                                                   gsm8k_file, tiny_model_dir):
    from areal_like.runtime.preflight import check_recipe_config

    path = _areal_layout(tmp_path, ref_form)
    overrides = [f"model.path={tiny_model_dir}", f"train_dataset.path={gsm8k_file}",
                 f"valid_dataset.path={gsm8k_file}", f"cluster.fileroot={tmp_path}"]
    config, _ = load_expr_config(["--config", str(path), *overrides], ArealiteGRPOConfig)
    # AReaL's keys where its scripts read them, ours where our engines do
    assert (config.ref is None) == (ref_form != "full") and not config.use_ref_model
    assert config.actor.path == config.model.path == str(tiny_model_dir)
    assert (config.algorithm.loss.eps_clip, config.algorithm.group_size) == (0.4, 4)
    assert (config.server.n_servers, config.launcher.n_trainer_procs) == (4, 4)
    assert (config.checkpoint.recover, config.saver.freq_epochs) == ("auto", 1)
    assert config.train_dataset.type == "gsm8k" and config.train_dataset.batch_size == 256
    assert config.actor.optimizer.type == "adamw" and config.actor.param_dtype == "bfloat16"
    check_recipe_config(config)  # the pre-flight reads an absent ref as no reference
    launch = load_launch_config(BaseExperimentConfig, path, overrides)  # the launcher's read
    assert launch.model.path == str(tiny_model_dir) and launch.server.n_servers == 4
    ppo, _ = load_expr_config(["--config", str(path), *overrides], ArealitePPOConfig)
    assert (ppo.ref is None) == (ref_form != "full") and ppo.critic.model.is_critic


@pytest.mark.parametrize("ref_form", ["full", "missing", "null"])
def test_arealite_kl_needs_its_ref_section(tmp_path, ref_form, gsm8k_file):
    path = _areal_layout(tmp_path, ref_form, kl_ctl=0.05)
    args = ["--config", str(path), "model.path=/m", f"train_dataset.path={gsm8k_file}",
            f"valid_dataset.path={gsm8k_file}"]
    if ref_form == "full":  # AReaL-lite builds the reference when kl_ctl > 0
        config, _ = load_expr_config(args, ArealiteGRPOConfig)
        assert config.use_ref_model and config.algorithm.kl.coef == 0.05
        return
    with pytest.raises(ConfigError, match=r"algorithm.kl.coef=0.05 is invalid: expected 0 "
                                          r"without a reference model .*add a `ref` section"):
        load_expr_config(args, ArealiteGRPOConfig)
