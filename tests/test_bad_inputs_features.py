"""Bad input to the newer features (off-policy corrections, filters, shaping, LoRA,
distillation, vision, presets) is refused by the launcher before any process starts.

Each case goes through `areal_like.launcher.local.main` as a user's command line would, with
`subprocess.Popen` replaced by a function that fails the test: the exit code must be 2 (a
config error), stderr must carry the message naming the key, and no server or trainer may
start. The model folders the checks read are real (tiny models built here).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from areal_like.launcher import local


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
           tiny_moe_dir: Path) -> dict[str, Path]:
    """The student (the session's tiny model), a model with another tokenizer of the same
    size (seed 2), one with a larger vocabulary, a tiny vision-language model and a tiny
    mixture of experts."""
    from areal_like.models.tiny import build_tiny_model
    from areal_like.models.tiny_vl import build_tiny_vl_model

    root = tmp_path_factory.mktemp("feature_models")
    return {"student": tiny_model_dir,
            "other_tokenizer": build_tiny_model(root / "seed2", size="1m", seed=2),
            "larger_vocab": build_tiny_model(root / "10m", size="10m", seed=1),
            "vl": build_tiny_vl_model(root / "vl"), "moe": tiny_moe_dir}


def _refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
             recipe: str, args: list[str]) -> str:
    """The launcher's stderr for a command it must refuse with exit 2 before starting
    anything."""
    def no_process(*a: object, **k: object) -> None:
        raise AssertionError(f"a process was started: {a[0] if a else k}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    code = local.main([recipe, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("config error: "), err
    return err


OFF_POLICY = "algorithm.off_policy."
CASES = [
    # off-policy corrections: bounds that mask every token, bounds nothing reads
    ("mis-low-past-default-high", "grpo",
     [f"{OFF_POLICY}correction=mis_token", f"{OFF_POLICY}correction_low=3"],
     "correction_low=3.0 is invalid: with correction='mis_token' the bounds would be "
     "low=3.0 >= high=2.0 (the other is the default), which masks every token"),
    ("mis-high-below-default-low", "grpo",
     [f"{OFF_POLICY}correction=mis_token", f"{OFF_POLICY}correction_high=0.3"],
     "the bounds would be low=0.5 >= high=0.3"),
    ("icepop-bounds-swapped", "grpo",
     [f"{OFF_POLICY}correction=icepop", f"{OFF_POLICY}correction_low=4",
      f"{OFF_POLICY}correction_high=2"],
     "correction_high=2.0 is invalid: with correction='icepop' the bounds would be low=4.0 "
     ">= high=2.0 (the other is set)"),
    ("mis-seq-low-above-one", "grpo",
     [f"{OFF_POLICY}correction=mis_seq", f"{OFF_POLICY}correction_low=1.05"],
     "correction_low=1.05 is invalid: expected < 1 with correction='mis_seq'"),
    ("tis-cap-below-one", "grpo",
     [f"{OFF_POLICY}correction=tis", f"{OFF_POLICY}correction_high=0.5"],
     "correction_high=0.5 is invalid: expected >= 1 with correction='tis'"),
    ("bound-without-correction", "grpo", [f"{OFF_POLICY}correction_low=0.5"],
     "correction_low=0.5 is invalid: expected None with correction='none'"),
    ("cap-without-decoupled-loss", "grpo",
     ["rollout.staleness.max_head_offpolicyness=0", f"{OFF_POLICY}decoupled=false",
      f"{OFF_POLICY}recompute_logprob=false"],
     "behav_imp_weight_cap=5.0 is invalid: expected None with decoupled=false"),
    # filters
    ("clip-filter-weight-off", "grpo", ["algorithm.filters.clip_filter_max_weight=2"],
     "clip_filter_max_weight=2.0 is invalid: expected 3.0 (unset) with "
     "clip_filter_weight=false"),
    ("rejection-budget-without-filter", "grpo", ["algorithm.filters.max_rejected_batches=3"],
     "max_rejected_batches=3 is invalid: expected 10 (unset) with dynamic_sampling=false"),
    ("rejection-budget-zero", "grpo",
     ["algorithm.filters.dynamic_sampling=true", "algorithm.filters.max_rejected_batches=0"],
     "max_rejected_batches=0 is invalid: expected >= 1"),
    ("dynamic-sampling-one-sample", "grpo",
     ["algorithm.filters.dynamic_sampling=true", "gconfig.n_samples=1",
      "algorithm.group_size=1"],
     "algorithm.filters.dynamic_sampling=true compares the samples of one prompt, but "
     "gconfig.n_samples=1"),
    ("clip-filter-one-sample", "grpo",
     ["algorithm.filters.clip_filter_weight=true", "gconfig.n_samples=1",
      "algorithm.group_size=1"], "algorithm.filters.clip_filter_weight=true compares"),
    # reward shaping
    ("overlong-tokens-penalty-off", "grpo", ["algorithm.shaping.overlong_tokens=3"],
     "overlong_tokens=3 is invalid: expected 0 (unset) with overlong_penalty=false"),
    ("overlong-factor-penalty-off", "grpo", ["algorithm.shaping.overlong_penalty_factor=0.5"],
     "overlong_penalty_factor=0.5 is invalid: expected 1.0 (unset) with overlong_penalty=false"),
    ("overlong-factor-negative", "grpo",
     ["algorithm.shaping.overlong_penalty=true", "algorithm.shaping.overlong_penalty_factor=-1"],
     "overlong_penalty_factor=-1.0 is invalid: expected > 0"),
    ("max-response-penalty-off", "grpo", ["algorithm.shaping.max_response_tokens=4"],
     "max_response_tokens=4 is invalid: expected 0 (unset) with overlong_penalty=false"),
    ("max-response-past-budget", "grpo",
     ["algorithm.shaping.overlong_penalty=true", "algorithm.shaping.max_response_tokens=64"],
     "max_response_tokens=64 is invalid: expected <= gconfig.max_new_tokens=6"),
    ("zero-reward-scaling", "grpo", ["algorithm.shaping.scaling=0"],
     "scaling=0.0 is invalid: expected != 0"),
    # LoRA
    ("lora-alpha-without-rank", "grpo", ["actor.lora.alpha=32"],
     "alpha=32 is invalid: expected unset (16) with rank=0"),
    ("lora-modules-without-rank", "grpo", ["actor.lora.target_modules=[q_proj]"],
     "target_modules=['q_proj'] is invalid: expected unset"),
    ("lora-unknown-module", "grpo",
     ["actor.lora.rank=4", "actor.lora.target_modules=[q_proj,qkv_proj]"],
     "actor.lora.target_modules names ['qkv_proj'], which the model at model.path="),
    ("lora-on-vllm", "grpo", ["actor.lora.rank=4", "server.backend=vllm"],
     "actor.lora.rank > 0 with a vLLM fleet"),
    ("lora-on-critic", "ppo", ["critic.lora.rank=4"],
     "critic.lora.rank=4 is invalid: expected 0: the critic's value head must train"),
    ("lora-on-reference", "grpo", ["use_ref_model=true", "ref.lora.rank=2"],
     "ref.lora.rank=2 is invalid: expected 0: the reference is frozen"),
    # distillation's teacher
    ("teacher-other-tokenizer", "distill", ["teacher.model_path={other_tokenizer}"],
     "does not share the student's tokenizer"),
    ("teacher-larger-vocabulary", "distill", ["teacher.model_path={larger_vocab}"],
     "their vocabularies differ (1024 and 512 tokens"),
    ("teacher-top-k-past-vocabulary", "distill",
     ["teacher.model_path={student}", "algorithm.preset=distill_full", "teacher.top_k=600"],
     "teacher.top_k=600 is larger than the teacher's vocabulary (512 tokens"),
    ("teacher-folder-missing", "distill", ["teacher.model_path=no/such/teacher"],
     "teacher.model_path='no/such/teacher' is not an HF model folder"),
    ("teacher-servers-for-running-fleet", "distill",
     ["teacher.server_addrs=[127.0.0.1:1]", "teacher.n_servers=2"],
     "n_servers=2 is invalid: expected unset (1) with teacher.server_addrs"),
    ("teacher-address-without-port", "distill", ["teacher.server_addrs=[nohost]"],
     "server_addrs='nohost' is invalid: expected entries of the form host:port"),
    ("teacher-top-k-unread", "distill", ["teacher.model_path={student}", "teacher.top_k=5"],
     "teacher.top_k=5 is invalid: expected > 0 with algorithm.kl.estimator=full"),
    # vision
    ("vision-workflow-text-model", "grpo",
     ["rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow"],
     "needs a vision-language model (images in the prompt), but model.path="),
    ("image-task-text-workflow", "grpo",
     ["model.path={vl}", "train_dataset.type=shapes", "valid_dataset.type=shapes"],
     "train_dataset.type='shapes' has images in its prompts, but rollout.workflow="),
    ("image-task-text-model", "grpo",
     ["train_dataset.type=shapes", "valid_dataset.type=shapes",
      "rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow"],
     "is a text-only model (its config.json has no vision_config"),
    ("vision-workflow-on-vllm", "grpo",
     ["model.path={vl}", "train_dataset.type=shapes", "valid_dataset.type=shapes",
      "rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow", "server.backend=vllm"],
     "sends images, which vLLM servers refuse here"),
    ("freeze-tower-text-model", "grpo", ["actor.freeze_vision_tower=true"],
     "actor.freeze_vision_tower=true, but model.path="),
    # the trainer's device mesh (actor.parallel): sizes against the ranks and the heads,
    # models Ulysses cannot split, engines whose layout differs from the actor's
    ("mesh-larger-than-the-trainer", "grpo", ["actor.parallel.sequence_parallel_size=2"],
     "actor.parallel.sequence_parallel_size=2 x actor.parallel.tensor_parallel_size=1 = 2 "
     "does not divide the trainer's world size 1 (launcher.n_trainer_procs)"),
    ("sequence-parallel-splitting-heads", "grpo",
     ["launcher.n_trainer_procs=3", "actor.parallel.sequence_parallel_size=3"],
     "actor.parallel.sequence_parallel_size=3 does not divide the model's "
     "num_attention_heads=4: each rank must hold whole attention heads"),
    ("sequence-parallel-vision-model", "grpo",
     ["model.path={vl}", "launcher.n_trainer_procs=2", "actor.parallel.sequence_parallel_size=2"],
     "actor.parallel.sequence_parallel_size=2 with the vision-language model at"),
    ("sequence-parallel-mixture-of-experts", "grpo",
     ["model.path={moe}", "launcher.n_trainer_procs=2", "actor.parallel.sequence_parallel_size=2"],
     "actor.parallel.sequence_parallel_size=2 with the mixture of experts at"),
    ("tensor-parallel-splitting-kv-heads", "grpo",
     ["launcher.n_trainer_procs=4", "actor.parallel.tensor_parallel_size=4"],
     "actor.parallel.tensor_parallel_size=4 does not divide the model's "
     "num_key_value_heads=2"),
    ("tensor-parallel-with-lora", "grpo",
     ["launcher.n_trainer_procs=2", "actor.parallel.tensor_parallel_size=2", "actor.lora.rank=4"],
     "actor.parallel.tensor_parallel_size=2 with actor.lora.rank=4: LoRA's adapters are not "
     "split"),
    ("critic-on-another-mesh", "ppo",
     ["launcher.n_trainer_procs=2", "actor.parallel.sequence_parallel_size=2"],
     "PPOConfig.critic.parallel=ParallelConfig(sequence_parallel_size=1, tensor_parallel_size=1)"
     " is invalid: expected the actor's layout"),
    # keys that mean something only for some models
    ("routed-experts-of-a-dense-model", "grpo", ["rollout.return_routed_experts=true"],
     "rollout.return_routed_experts=true, but model.path="),
    ("checkpointing-stride-past-the-layers", "grpo",
     ["actor.gradient_checkpointing=true", "actor.gradient_checkpointing_every=9"],
     "actor.gradient_checkpointing_every=9 is past the model's 4 decoder layers"),
    ("online-dpo-one-sample", "online_dpo", ["algorithm.group_size=1"],
     "algorithm.group_size=1: online DPO pairs a prompt's best sample with its worst"),
    ("log-dir-is-a-file", "grpo", ["logging.log_dir={student}/config.json"],
     "config.json is a file, not a folder"),
    ("switch-set-to-a-number", "grpo", ["checkpoint.async_save=2"],
     "checkpoint.async_save=2: checkpoint.async_save is a switch; expected true or false"),
    # GPU-only settings for a trainer on this (CPU) machine
    ("offload-on-a-cpu-trainer", "grpo", ["actor.cpu_offload=true"],
     "actor.cpu_offload=true on a CPU trainer (no CUDA device is visible)"),
    ("nccl-on-a-cpu-trainer", "ppo", ["critic.backend=nccl"],
     "critic.backend=nccl: no CUDA device is visible on this machine"),
    # trackers: where they write, and settings of one that is off
    ("trackio-dir-past-a-file", "grpo",
     ["logging.trackio.enabled=true", "logging.trackio.dir={student}/config.json/trackio"],
     "logging.trackio.dir="),
    ("mlflow-store-past-a-file", "grpo",
     ["logging.mlflow.enabled=true", "logging.mlflow.tracking_uri=sqlite:///{student}/config.json/m.db"],
     "config.json is a file, not a folder"),
    ("tracker-setting-while-off", "grpo", ["logging.trackio.project=mine"],
     "logging.trackio.project='mine' is set but logging.trackio.enabled=false: nothing reads it"),
    # presets on recipes that cannot use them
    ("preset-on-sft", "sft", ["algorithm.preset=dapo"],
     "algorithm.preset='dapo', algorithm.loss.eps_clip_high=0.28, "
     "algorithm.shaping.overlong_penalty=True, algorithm.filters.dynamic_sampling=True: the "
     "sft recipe trains on the task's answers with cross-entropy and reads no algorithm"),
    ("kl-preset-without-reference", "grpo", ["algorithm.preset=reinforce_pp"],
     "algorithm.kl.coef=0.01 is invalid: expected 0 without a reference model"),
    ("dapo-on-one-sample-recipe", "multi_turn", ["algorithm.preset=dapo"],
     "algorithm.filters.dynamic_sampling=true compares the samples of one prompt"),
    ("distill-without-teacher-preset", "distill",
     ["teacher.model_path={student}", "algorithm.preset=grpo"],
     "algorithm.kl.coef=0.0 is invalid: expected > 0: it weighs the teacher's per-token "
     "reward (the distill and distill_full presets set it)"),
]


@pytest.mark.parametrize("recipe,overrides,message", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_feature_key_the_run_cannot_honour_is_refused_before_anything_starts(
        models, monkeypatch, capsys, recipe, overrides, message):
    if "CPU trainer" in message or "no CUDA device" in message:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: GPU-only settings are honoured here")
    paths = {name: str(path) for name, path in models.items()}
    args = [f"model.path={paths['student']}", *[o.format(**paths) for o in overrides]]
    err = _refused(monkeypatch, capsys, recipe, args)
    assert message in err, err


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "rloo", "gspo", "remax",
                                    "ppo", "cispo", "cpgd"])
def test_every_preset_composes_on_the_main_job_recipe(preset, tiny_model_dir):
    """`algorithm.preset=X` on the main job's YAML: DAPO's overlong buffer follows the
    recipe's generation budget (a fifth of it, at least one token) unless it is set."""
    from areal_like.launcher.target import resolve_target

    target = resolve_target("grpo", [f"model.path={tiny_model_dir}",
                                     f"algorithm.preset={preset}"])
    shaping = target.config.algorithm.shaping
    if preset == "dapo":
        budget = target.config.gconfig.max_new_tokens
        assert shaping.overlong_penalty and shaping.max_response_tokens == budget
        assert shaping.overlong_tokens == max(1, round(budget / 5))
    else:
        assert not shaping.overlong_penalty and shaping.overlong_tokens == 0


def test_dapo_keeps_an_overlong_buffer_the_user_sets(tiny_model_dir):
    from areal_like.launcher.target import resolve_target

    target = resolve_target("grpo", [f"model.path={tiny_model_dir}", "algorithm.preset=dapo",
                                     "gconfig.max_new_tokens=64", "server.context_length=1024",
                                     "algorithm.shaping.overlong_tokens=16"])
    assert target.config.algorithm.shaping.overlong_tokens == 16
    assert target.config.algorithm.shaping.max_response_tokens == 64


def test_a_vision_run_on_a_vision_model_passes_the_checks(models):
    from areal_like.launcher.target import resolve_target

    target = resolve_target("grpo", [f"model.path={models['vl']}", "train_dataset.type=shapes",
                                     "valid_dataset.type=shapes", "actor.freeze_vision_tower=true",
                                     "rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow"])
    assert target.config.actor.freeze_vision_tower


def test_a_teacher_with_the_students_tokenizer_files_passes(models, tmp_path):
    """A teacher folder whose tokenizer files are laid out differently but map every token
    alike (the same tokenizer saved again) is accepted."""
    import shutil

    from transformers import AutoTokenizer

    from areal_like.launcher.target import resolve_target

    teacher = tmp_path / "teacher"
    shutil.copytree(models["student"], teacher)
    AutoTokenizer.from_pretrained(models["student"]).save_pretrained(teacher)
    (teacher / "tokenizer_config.json").write_text(
        (teacher / "tokenizer_config.json").read_text().replace("\n", "\n  "))
    target = resolve_target("distill", [f"model.path={models['student']}",
                                        f"teacher.model_path={teacher}"])
    assert target.config.teacher.model_path == str(teacher)
