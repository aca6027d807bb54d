"""AReaL-lite's document code, ported by changing imports (examples/arealite), runs for a few
steps under torchrun, started by our launcher as a user's script, on the session's real SGLang
fleet (as new: session weights at version 0)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from config_helpers import rollout_config
from sglang_helpers import attach_args

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.mark.sglang
@pytest.mark.e2e
def test_remax_reinforce_document_loop_trains_and_moves_the_fleets_weights(tiny_model_dir,
                                                                          tmp_path, fresh_fleet):
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "examples/arealite/train_reinforce.py",
         "--config", "examples/arealite/reinforce.yaml", f"model.path={tiny_model_dir}",
         *attach_args(fresh_fleet),
         f"logging.log_dir={tmp_path}", "total_train_steps=3"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    logs = list(tmp_path.rglob("trainer.log"))
    assert len(logs) == 1, logs
    steps = [json.loads(line[line.index("{"):]) for line in logs[0].read_text().splitlines()
             if '"step"' in line]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert math.isfinite(s["loss"]) and len(s["reward"]) == 4  # one row per prompt
        assert all(-1.0 <= r <= 1.0 for r in s["reward"])  # r(sample) - r(greedy)
        # rollout_batch is synchronous: step k's tokens come from the weights uploaded after
        # step k - 1, which the fleet serves labelled k
        assert s["versions"] == [s["step"]]
    weights = sorted(p.name for p in (tmp_path / "arealite_weights").iterdir())
    assert weights == ["v1", "v2", "v3"]



@pytest.mark.sglang
@pytest.mark.e2e
def test_grpo_script_runs_asynchronously_with_evaluation_beside_it(tiny_model_dir, tmp_path,
                                                                   fresh_fleet):
    """AReaL-lite's GRPO script (its RLVR workflow, custom reward, PPO actor, saver, stats
    logger, evaluator and a second engine for evaluation), eta = 1, with its config in
    AReaL-lite's own format (sections, key names, allocation_mode; 1 epoch of 3 steps)."""
    from areal_like.utils.metrics_logger import read_metrics

    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "examples/arealite/gsm8k_grpo.py",
         "--config", "examples/arealite/gsm8k_grpo.yaml", f"model.path={tiny_model_dir}",
         *attach_args(fresh_fleet), f"cluster.fileroot={tmp_path}"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    run = tmp_path / "arealite_gsm8k_grpo" / "trial0"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["grpo_actor/actor/update/update_successful"] == 1.0 for r in records)
    assert all(r["actor/version_lag/max"] <= 1 for r in records)  # eta = 1
    evals = [r for r in records if "grpo-eval/n_seqs" in r]
    assert [r["step"] for r in evals] == [2] and evals[0]["grpo-eval/n_seqs"] == 40 * 4
    # the workflow's dump: one folder per version it generated with — training: version 0
    # first, then whichever of 1, 2, 3 a batch started at (timing: after the last update the
    # controller may start episodes the run ends before using); evaluation: its 1e12 label
    dumped = {p.name for p in (run / "generated").iterdir()}
    assert "0" in dumped and dumped <= {"0", "1", "2", "3", str(10**12)}, dumped
    assert (run / "checkpoints" / "epoch0_step2_global2" / "config.json").is_file()
    # WeightUpdateMeta.from_disk(config.saver): the fleet loaded from the saver's folder
    assert (run / "checkpoints" / "weight_update" / "model.safetensors").is_file()
    assert "config (AReaL-lite): sglang.random_seed" in proc.stdout  # a differing meaning


@pytest.mark.sglang
@pytest.mark.e2e
@pytest.mark.parametrize("ref_form", ["missing", "null"])
def test_grpo_script_trains_without_a_reference_section(tiny_model_dir, tmp_path, fresh_fleet,
                                                        ref_form):
    """The same script and YAML as AReaL-lite users write it to train without a KL reference:
    no `ref` section, or `ref: null` (regression: the config check read `ref.lora` and the
    trainer crashed at load). One step of 12 prompts (the full form runs above)."""
    import yaml

    from areal_like.utils.metrics_logger import read_metrics

    raw = yaml.safe_load((REPO / "examples/arealite/gsm8k_grpo.yaml").read_text())
    if ref_form == "missing":
        del raw["ref"]
    else:
        raw["ref"] = None
    config = tmp_path / "gsm8k_grpo_no_ref.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.launcher.local", "examples/arealite/gsm8k_grpo.py",
         "--config", str(config), f"model.path={tiny_model_dir}", *attach_args(fresh_fleet),
         f"cluster.fileroot={tmp_path}", "train_dataset.batch_size=12"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = read_metrics(tmp_path / "arealite_gsm8k_grpo" / "trial0" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    assert records[0]["grpo_actor/actor/update/update_successful"] == 1.0
    assert not any(k.startswith("ref_logp") or "/ref_logp" in k for k in records[0])

sys.path.insert(0, str(REPO / "examples" / "arealite"))


def test_reinforce_loss_matches_a_float64_reference():
    import torch
    from reinforce_actor import reinforce_loss_fn
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=gen)
    ids = torch.randint(0, 11, (7,), generator=gen)
    rewards = torch.randn(7, generator=gen)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    data = TensorDict({"input_ids": ids, "loss_mask": mask, "rewards": rewards}, batch_size=[7])
    ref_logp = torch.log_softmax(logits.double(), -1).gather(
        -1, torch.roll(ids, -1)[:, None]).squeeze(-1)
    expected = (-(ref_logp * rewards.double()) * mask).sum() / mask.sum()
    assert reinforce_loss_fn(logits, data).item() == pytest.approx(expected.item(), abs=1e-6)


def test_fsdp_reinforce_actor_makes_a_rewarded_sequence_likelier(tiny_model_dir):
    """The document's two-class actor on our FSDP engine: one step with reward +1 on a row
    raises that row's log-likelihood; -1 lowers it."""
    import torch
    from reinforce_actor import FSDPReinforceActor
    from tensordict import TensorDict

    from areal_like.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
    from areal_like.arealite import FinetuneSpec

    actor = FSDPReinforceActor(config=TrainEngineConfig(
        model=ModelConfig(path=str(tiny_model_dir)), optimizer=OptimizerConfig(lr=1e-3)))
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8,
                                        train_batch_size=4))
    try:
        ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
        batch = TensorDict({
            "input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * 4 + [1] * 8] * 2),
            "rewards": torch.tensor([[1.0] * 12, [-1.0] * 12]),
        }, batch_size=[2])
        before = actor.forward(batch)
        stats = actor.train_reinforce(batch)
        after = actor.forward(batch)
        assert stats["update_successful"] == 1.0
        # the document's loss pairs loss_mask[t] with the log-prob of token t + 1
        trained = batch["loss_mask"].bool()
        trained[:, -1] = False
        gain = ((after - before) * trained).sum(dim=1)
        assert gain[0] > 0 > gain[1], gain
    finally:
        actor.destroy()


def test_finetune_spec_and_initialize_arguments_are_checked():
    from areal_like.arealite import FinetuneSpec, RemoteSGLangEngine

    spec = FinetuneSpec(total_train_epochs=3, dataset_size=100, train_batch_size=8)
    assert (spec.steps_per_epoch, spec.total_train_steps) == (12, 36)
    with pytest.raises(ValueError, match=r"FinetuneSpec.train_batch_size=0 is invalid"):
        FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=0)
    rollout = RemoteSGLangEngine(rollout_config(server_addrs=["127.0.0.1:1"]))
    with pytest.raises(ValueError, match=r"initialize\(addr='10.0.0.1:9'\).*server_addrs"):
        rollout.initialize("10.0.0.1:9", spec)


def test_an_arealite_tokenizer_gives_ids_and_a_request_refuses_a_dict(tiny_model_dir):
    """AReaL-lite code (transformers 4) takes apply_chat_template(tokenize=True) for the ids;
    transformers 5 returns a dict, which reached the server as ['input_ids',
    'attention_mask'] (HTTP 400). load_hf_tokenizer gives the ids; a request refuses a dict
    naming the fix."""
    import pickle

    from transformers import AutoTokenizer

    from areal_like.arealite import LLMRequest, load_hf_tokenizer

    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    tokenizer = load_hf_tokenizer(str(tiny_model_dir))
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    as_dict = plain.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == list(as_dict["input_ids"])
    assert tokenizer.decode(ids) == plain.decode(ids) and len(tokenizer) == len(plain)
    assert tokenizer.eos_token_id == plain.eos_token_id
    again = pickle.loads(pickle.dumps(tokenizer))  # workflows travel to the rollout process
    assert again.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == ids
    assert LLMRequest(input_ids=ids).input_ids == ids
    with pytest.raises(TypeError, match=r"keys \['input_ids', 'attention_mask'\].*"
                                        r"return_dict=False"):
        LLMRequest(input_ids=as_dict)
    with pytest.raises(TypeError, match="item 1 is 'x'"):
        LLMRequest(input_ids=[1, "x"])


@pytest.mark.sglang
def test_connect_engine_then_update_weights_moves_the_fleet(sglang_fleet, tiny_model_dir,
                                                            tmp_path):
    """AReaL-lite's newer weight call: connect_engine once, then update_weights does the
    export, the fleet's load and the barrier; the servers report the new version."""
    from conftest import SGLANG_TEST_API_KEY
    from sglang_helpers import fleet_version

    from areal_like.api.config import ModelConfig, TrainEngineConfig
    from areal_like.arealite import FSDPEngine, RemoteSGLangEngine, WeightUpdateMeta

    rollout = RemoteSGLangEngine(rollout_config(server_addrs=list(sglang_fleet.addresses),
                                               api_key=SGLANG_TEST_API_KEY))
    rollout.initialize(None, None)
    actor = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir))))
    actor.initialize(None, None)
    try:
        version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY) + 1
        rollout.set_version(version - 1)  # AReaL-lite: the version after the current one
        meta = WeightUpdateMeta.from_disk(str(tmp_path / "w"), version)
        actor.connect_engine(rollout, meta)
        actor.update_weights(meta)  # unchanged weights: the fleet keeps serving the same model
        assert fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY) == version
        assert (tmp_path / "w" / "config.json").is_file()
    finally:
        actor.destroy()
        rollout.destroy()
