"""AReaL-lite experiment YAMLs load as AReaL-lite writes them: each key mapped to ours (and
kept under its AReaL-lite name for a ported script), refused with the replacement, or
noticed where the meaning differs. The YAML is examples/arealite/gsm8k_grpo.yaml, which has
every section of AReaL-lite's examples/lite/configs/gsm8k_grpo.yaml (its e2e run is in
test_arealite_examples.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_like.api.config import BaseExperimentConfig
from areal_like.api.config_loader import ConfigError, load_config, load_launch_config
from areal_like.api.lora_config import DECODER_LINEAR_MODULES
from areal_like.arealite import (
    Evaluator,
    FinetuneSpec,
    GRPOConfig,
    Saver,
    StatsLogger,
    WeightUpdateMeta,
    load_expr_config,
)
from areal_like.utils.metrics_logger import run_dir
from recipes.configs import GRPOConfig as OurGRPOConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "arealite" / "gsm8k_grpo.yaml"


def _yaml(tmp_path: Path, **changes: dict) -> Path:
    """The example YAML with `changes` ({section: {key: value}} or {key: value}) applied."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    path = tmp_path / "arealite.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_arealite_section_maps_to_ours_and_stays_readable(tmp_path, capsys):
    path = _yaml(tmp_path, allocation_mode="sglang.d4p1t2+d2p1t1",
                 actor={"kl_ctl": 0.05, "eps_clip_higher": 0.28, "group_adv_norm": True},
                 recover={"mode": "auto", "freq_steps": 5},
                 stats_logger={"wandb": {"mode": "online"}},
                 train_dataset={"path": str(tmp_path / "gsm8k.jsonl"), "drop_last": False})
    config, _ = load_expr_config(["--config", str(path), "model.path=/m", "seed=7",
                                  "cluster.fileroot=/runs"], GRPOConfig)
    # the model: actor.path, and everything that references it, follow model.path=
    assert config.model.path == config.actor.model.path == config.actor.path == "/m"
    assert config.tokenizer_path == config.model.tokenizer_path == "/m"
    assert config.ref is not None and config.ref.model.path == "/m"
    # PPO keys: read from actor by the script, and ours in algorithm
    assert (config.actor.eps_clip, config.algorithm.loss.eps_clip) == (0.4, 0.4)
    assert config.algorithm.loss.eps_clip_high == 0.28
    assert (config.algorithm.shaping.scaling, config.algorithm.shaping.bias) == (10.0, -0.5)
    assert config.algorithm.off_policy.behav_imp_weight_cap == 5.0
    assert config.algorithm.group_size == config.gconfig.n_samples == 4
    assert config.algorithm.norm.level == "group"
    assert config.algorithm.kl.coef == 0.05 and config.use_ref_model  # AReaL-lite builds ref
    assert config.actor.algorithm().kl.coef == 0.05
    assert config.actor.optimizer.type == "adamw" and config.actor.backend == "auto"
    # placement, servers, logging, checkpoints, evaluation
    assert (config.server.n_servers, config.server.gpus_per_server) == (4, 2)
    assert config.launcher.n_trainer_procs == 2
    assert (config.server.context_length, config.server.mem_fraction_static) == (1024, 0.1)
    assert (config.logging.experiment_name, config.logging.log_dir) == (
        "arealite_gsm8k_grpo", "/runs")
    assert config.logging.wandb.enabled and config.logging.wandb.mode == "online"
    assert (config.checkpoint.recover, config.checkpoint.freq_steps) == ("auto", 5)
    assert config.evaluation.freq_steps == 2
    # AReaL-lite's own sections, as a ported script reads them
    assert (config.saver.freq_steps, config.saver.fileroot) == (3, "/runs")
    assert config.total_train_epochs == 1 and config.async_training
    assert config.train_dataset.type == "gsm8k"  # type: rl with a path
    assert config.train_dataset.drop_last is False and config.valid_dataset.type == "addition"
    assert config.seed == 7
    err = capsys.readouterr().err
    assert "config (AReaL-lite): cluster.fileroot=/runs" in err
    assert "sglang.random_seed" in err and "train_dataset.type=rl" in err
    assert "total_train_epochs" not in err  # the script reads it: no difference to say


def test_our_schemas_and_the_launcher_read_an_arealite_yaml(tmp_path, capsys):
    ours = load_config(OurGRPOConfig, EXAMPLE, ["model.path=/m"])
    assert type(ours) is OurGRPOConfig and ours.algorithm.loss.eps_clip == 0.4
    assert ours.actor.model.path == "/m" and ours.algorithm.off_policy.recompute_logprob
    assert "total_train_epochs=1: our recipes stop at total_train_steps" in capsys.readouterr().err
    launch = load_launch_config(BaseExperimentConfig, EXAMPLE,
                                ["model.path=/m", "cluster.fileroot=/r",
                                 "rollout.server_addrs=[127.0.0.1:1]"])
    assert launch.model.path == "/m" and launch.rollout.server_addrs == ["127.0.0.1:1"]
    assert run_dir(launch.logging) == Path("/r/arealite_gsm8k_grpo/trial0")
    assert capsys.readouterr().err == ""  # the script says the notices, not the launcher


@pytest.mark.parametrize("changes,needle", [
    ({"actor": {"init_from_scratch": True}}, "actor.init_from_scratch=True: a model is always"),
    ({"actor": {"backend": "megatron"}}, "actor.backend='megatron': the train engine here is"),
    ({"actor": {"use_lora": True, "peft_type": "ia3"}}, "actor.peft_type='ia3': only LoRA"),
    ({"actor": {"mask_no_eos_with_zero": True}}, "algorithm.shaping.overlong_penalty"),
    ({"actor": {"adv_norm": {"mean_level": "batch", "std_level": "group"}}},
     "algorithm.norm.level"),
    ({"allocation_mode": "vllm.d2+d2"}, "allocation_mode='vllm.d2+d2': only"),
    ({"server_only": True}, "areal-like serve"),
    ({"recover": {"mode": "sometimes"}}, "recover.mode='sometimes'"),
])
def test_keys_without_a_counterpart_are_refused_naming_the_replacement(tmp_path, changes,
                                                                       needle):
    with pytest.raises(ConfigError) as info:
        load_config(GRPOConfig, _yaml(tmp_path, **changes), [])
    assert needle in str(info.value) and "arealite.yaml" in str(info.value)


def test_arealite_lora_keys_become_our_lora_section(tmp_path):
    config = load_config(GRPOConfig, _yaml(tmp_path, actor={
        "use_lora": True, "lora_rank": 16, "lora_alpha": 32, "target_modules": ["all-linear"],
        "peft_type": "lora"}), [])
    assert (config.actor.lora.rank, config.actor.lora.alpha) == (16, 32)
    assert config.actor.lora.target_modules == list(DECODER_LINEAR_MODULES)
    # the servers serve the adapter, the client names it
    assert config.server.lora_rank == 16 and config.rollout.lora_adapter == "policy"
    off = load_config(GRPOConfig, _yaml(tmp_path, actor={"use_lora": False, "lora_rank": 8}),
                      [])
    assert off.actor.lora.rank == 0 and off.rollout.lora_adapter == ""


def test_a_typo_in_an_arealite_yaml_is_still_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(GRPOConfig, _yaml(tmp_path, gconfig={"max_new_tokenz": 3}), [])
    assert "gconfig.max_new_tokenz" in str(info.value) and "max_new_tokens" in str(info.value)


def test_saver_evaluator_and_weights_follow_arealite_rules(tmp_path, monkeypatch):
    config = load_config(GRPOConfig, _yaml(tmp_path, saver={"freq_steps": None,
                                                             "freq_epochs": 2},
                                           evaluator={"freq_steps": None, "freq_secs": 100}),
                         [f"cluster.fileroot={tmp_path}"])
    spec = FinetuneSpec(total_train_epochs=4, dataset_size=12, train_batch_size=4)  # 3/epoch
    saver = Saver(config.saver, spec)
    due = [g for g in range(12) if saver.due(g // 3, g % 3, g)]
    assert due == [5, 11]  # the last step of every second epoch
    clock = [1000.0]
    monkeypatch.setattr("areal_like.arealite.training.time.monotonic", lambda: clock[0])
    evaluator, calls = Evaluator(config.evaluator, spec), []
    for global_step, now in enumerate([1050.0, 1100.0, 1150.0, 1210.0]):
        clock[0] = now
        evaluator.evaluate(lambda g=global_step: calls.append(g), 0, global_step, global_step)
    assert calls == [1, 3]  # 100 s after the start, then 100 s after that
    run = tmp_path / "arealite_gsm8k_grpo" / "trial0"
    assert StatsLogger.get_log_path(config.stats_logger) == str(run)
    assert Saver.get_save_checkpoint_root(config.saver) == str(run / "checkpoints")
    meta = WeightUpdateMeta.from_disk(config.saver)
    assert meta.type == "disk" and meta.path == str(run / "checkpoints" / "weight_update")
    assert WeightUpdateMeta.from_disk("/w", 3).path == "/w"  # ours, unchanged


def test_our_own_yaml_loads_into_the_arealite_classes():
    """A YAML of our format (a defaults list naming grpo_schema) read by a ported script:
    AReaL-lite's extra sections take their defaults."""
    config, _ = load_expr_config(["--config", str(REPO / "examples/arealite/reinforce.yaml"),
                                  "model.path=/m"], GRPOConfig)
    assert type(config) is GRPOConfig and config.actor.model.path == "/m"
    assert config.total_train_steps == 3 and config.saver.freq_steps is None
    assert config.ref is not None and config.ref.model.path == ""  # ours always has ref
