"""The `algorithm` section: nested by concern, presets from YAML and the command line, old
flat keys refused with their new place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from areal_like.api.algorithm_config import MOVED_KEYS, AlgorithmConfig
from areal_like.api.algorithm_presets import (
    PRESETS,
    AlgorithmKeyError,
    algorithm_config,
    algorithm_preset,
    register_algorithm_preset,
)
from areal_like.api.config_loader import ConfigError, load_config
from recipes.configs import GRPOConfig

CONF = Path(__file__).resolve().parents[1] / "recipes" / "conf"


def _yaml(tmp_path: Path, algorithm: str, parent: str = "grpo_schema") -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(f"defaults:\n  - {parent}\n  - _self_\nalgorithm:\n{algorithm}")
    return path


def _leaves(obj: object, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def test_every_old_flat_key_has_one_new_place():
    """41 flat keys (43 fields less group_size and temperature), each at a distinct leaf;
    the other leaves are the keys added since."""
    leaves = set(_leaves(AlgorithmConfig()))
    assert len(MOVED_KEYS) == 41 and len(set(MOVED_KEYS.values())) == 41
    assert leaves - set(MOVED_KEYS.values()) == {
        "preset", "group_size", "temperature", "off_policy.correction",
        "off_policy.correction_low", "off_policy.correction_high", "kl.discount",
        "filters.max_rejected_batches"}


def test_preset_from_yaml_is_overridden_key_by_key(tmp_path):
    path = _yaml(tmp_path, "  preset: dapo\n  loss:\n    eps_clip_high: 0.3\n"
                 "  filters:\n    dynamic_sampling: false\n")
    cfg = load_config(GRPOConfig, path, ["algorithm.loss.eps_clip=0.15",
                                          "gconfig.max_new_tokens=64",
                                          "algorithm.shaping.overlong_tokens=16"])
    algo = cfg.algorithm
    assert algo.preset == "dapo"
    # the YAML's and the command line's keys win, even when they set a default value
    assert (algo.loss.eps_clip_high, algo.loss.eps_clip) == (0.3, 0.15)
    assert algo.filters.dynamic_sampling is False
    # the preset's other values are in place
    assert algo.shaping.overlong_penalty is True and algo.loss.agg_mode == "token-mean"
    # what the recipe fills in from generation still happens after the preset
    assert algo.shaping.max_response_tokens == 64
    # the same values as the Python spelling
    same = algorithm_preset("dapo", loss={"eps_clip_high": 0.3, "eps_clip": 0.15},
                            filters={"dynamic_sampling": False},
                            shaping={"overlong_tokens": 16, "max_response_tokens": 64})
    assert _leaves(same) == {**_leaves(algo), "loss.agg_constant": None}


def test_preset_from_the_command_line_and_in_a_parent_yaml(tmp_path):
    base = load_config(GRPOConfig, CONF / "grpo_addition.yaml")
    gspo = load_config(GRPOConfig, CONF / "grpo_addition.yaml", ["algorithm.preset=gspo"])
    assert (gspo.algorithm.loss.policy, gspo.algorithm.loss.eps_clip) == ("gspo", 3e-4)
    # the YAML's own off_policy keys stay; group_size is the YAML's
    assert gspo.algorithm.off_policy == base.algorithm.off_policy
    assert gspo.algorithm.group_size == base.algorithm.group_size
    # a child of a YAML that names a preset: the parent's keys and the child's both beat it
    child = tmp_path / "child.yaml"
    child.write_text("defaults:\n  - grpo_addition\n  - _self_\nalgorithm:\n  preset: dapo\n"
                     "  loss:\n    agg_mode: seq-mean-token-sum\n")
    cfg = load_config(GRPOConfig, child, ["algorithm.shaping.overlong_tokens=2"])
    assert cfg.algorithm.loss.agg_mode == "seq-mean-token-sum"
    assert cfg.algorithm.off_policy.behav_imp_weight_cap == 5.0  # grpo_addition's
    assert cfg.algorithm.filters.dynamic_sampling is True  # dapo's


def test_shipped_yamls_keep_their_algorithms():
    """The values each shipped recipe trained with before the sections existed."""
    grpo = load_config(GRPOConfig, CONF / "grpo_addition.yaml").algorithm
    assert (grpo.adv.estimator, grpo.loss.policy, grpo.loss.agg_mode) == (
        "grpo", "ppo", "seq-mean-token-mean")
    assert (grpo.off_policy.decoupled, grpo.off_policy.behav_imp_weight_cap) == (True, 5.0)
    remax = load_config(GRPOConfig, CONF / "remax_addition.yaml").algorithm
    assert (remax.adv.estimator, remax.loss.policy, remax.off_policy.decoupled,
            remax.off_policy.recompute_logprob) == ("remax", "reinforce", True, True)
    from recipes.configs import MultiTurnConfig, PPOPRMConfig

    multi = load_config(MultiTurnConfig, CONF / "multi_turn_addition.yaml").algorithm
    assert (multi.adv.estimator, multi.kl.coef, multi.loss.agg_mode) == (
        "reinforce_pp", 0.0, "token-mean")
    prm = load_config(PPOPRMConfig, CONF / "ppo_prm_addition.yaml").algorithm
    assert (prm.adv.estimator, prm.norm.level, prm.adv.gae_lambda, prm.update.epochs,
            prm.update.n_minibatches) == ("gae", "batch", 0.95, 4, 2)


@pytest.mark.parametrize("old", ["kl_ctl", "adv_estimator", "use_decoupled_loss",
                                 "ppo_epochs", "adv_norm_level"])
def test_an_old_flat_key_names_its_new_place(tmp_path, old):
    new = f"algorithm.{MOVED_KEYS[old]}"
    with pytest.raises(ConfigError, match=f"'algorithm.{old}' is now '{new}'"):
        load_config(GRPOConfig, CONF / "grpo_addition.yaml", [f"algorithm.{old}=1"])
    with pytest.raises(ConfigError, match=f"'algorithm.{old}' is now '{new}'"):
        load_config(GRPOConfig, _yaml(tmp_path, f"  {old}: 1\n"))
    with pytest.raises(AlgorithmKeyError, match=f"'algorithm.{old}' is now '{new}'"):
        algorithm_config(**{old: 1})


def test_unknown_presets_and_keys_are_named():
    with pytest.raises(ConfigError, match="algorithm.preset='dapoo' is not a registered preset; "
                                          "did you mean 'dapo'"):
        load_config(GRPOConfig, CONF / "grpo_addition.yaml", ["algorithm.preset=dapoo"])
    with pytest.raises(AlgorithmKeyError, match="'algorithm.loss.eps_clipp': did you mean "
                                                "'algorithm.loss.eps_clip'"):
        algorithm_preset("grpo", loss={"eps_clipp": 0.1})
    with pytest.raises(ValueError, match=r"algorithm.loss.eps_clip=-0.1 is invalid"):
        algorithm_preset("grpo", loss={"eps_clip": -0.1})


def test_a_registered_preset_is_selectable_from_yaml():
    register_algorithm_preset("test_rloo_k2", {"adv": {"estimator": "rloo"},
                                               "kl": {"estimator": "k2"}})
    try:
        cfg = load_config(GRPOConfig, CONF / "grpo_addition.yaml",
                          ["algorithm.preset=test_rloo_k2"])
        assert (cfg.algorithm.adv.estimator, cfg.algorithm.kl.estimator) == ("rloo", "k2")
        with pytest.raises(ValueError, match="already registered"):
            register_algorithm_preset("test_rloo_k2", {})
        with pytest.raises(AlgorithmKeyError, match="'algorithm.kl_ctl' is now"):
            register_algorithm_preset("test_bad", {"kl_ctl": 0.1})
    finally:
        PRESETS.pop("test_rloo_k2", None)
