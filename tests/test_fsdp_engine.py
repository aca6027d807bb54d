"""FSDPEngine under a real `torchrun --nproc_per_node=2` on CPU (gloo), against references
computed here with plain PyTorch / transformers in one process (no FSDP, no packing).

One launch of tests/fsdp_worker.py runs every scenario; each test checks one of them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_reference import max_diff, per_sequence_outputs, reference_steps
from safetensors.torch import load_file
from torchrun_helpers import run_worker
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.torchrun, pytest.mark.e2e]


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp_worker")
    res = run_worker("fsdp_worker.py", tiny_model_dir, out)
    res["out"], res["model_dir"] = out, tiny_model_dir
    return res


@pytest.fixture(scope="module")
def reference(run: dict[str, Any]) -> tuple[list, list]:
    stats, params, _ = reference_steps(run["model_dir"], [run["batch1"], run["batch2"]])
    return stats, params


def test_data_parallel_split_is_real(run: dict[str, Any]) -> None:
    assert run["world_size"] == 2
    assert 0 < run["local_rows_rank0"] < run["batch1"]["input_ids"].shape[0]


def test_train_steps_match_single_process_reference(run: dict[str, Any], reference) -> None:
    ref_stats, ref_params = reference
    for i, name in enumerate(["step1", "step2"]):
        got = run[name]
        assert got["update_successful"] == 1.0
        assert got["loss"] == pytest.approx(ref_stats[i]["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(ref_stats[i]["grad_norm"], rel=1e-5)
        assert got["lr"] == pytest.approx(ref_stats[i]["lr"], rel=1e-12)
    n_ref_tokens = int(run["batch1"]["attention_mask"].sum())
    assert run["step1"]["n_tokens"] == n_ref_tokens
    assert max_diff(run["params_step1"], ref_params[0]) < 1e-5
    assert max_diff(run["params_step2"], ref_params[1]) < 1e-5
    # the check is meaningful: the steps moved the weights by much more than the tolerance
    assert max_diff(run["params_step2"], run["params_step1"]) > 1e-3


def test_eval_batch_matches_train_loss(run: dict[str, Any]) -> None:
    assert run["eval_loss_before"] == pytest.approx(run["step1"]["loss"], rel=1e-6)


def _per_sequence(run: dict[str, Any], critic: bool = False) -> list[dict[str, torch.Tensor]]:
    """Each row of batch1 through the plain model on its own (no packing, no padding)."""
    return per_sequence_outputs(run["model_dir"], run["batch1"],
                                run["out"] / "critic_export" if critic else None)


def test_packed_forward_equals_per_sequence_forward(run: dict[str, Any]) -> None:
    logp, ent = run["forward_logprobs"], run["forward_entropy"]
    attn = run["batch1"]["attention_mask"]
    assert logp.shape == attn.shape
    for b, ref in enumerate(_per_sequence(run)):
        n = int(attn[b].sum())
        torch.testing.assert_close(logp[b, : n - 1].double(), ref["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[b, :n].double(), ref["entropy"], atol=1e-5, rtol=0)
        assert logp[b, n - 1] == 0 and (logp[b, n:] == 0).all() and (ent[b, n:] == 0).all()
        assert run["forward_rows"][b].shape == (n,)


def test_micro_batch_count_does_not_change_the_update(run: dict[str, Any]) -> None:
    assert run["mb4_step1"]["n_mbs"] >= 4
    for name in ("step1", "step2"):
        assert run[f"mb4_{name}"]["loss"] == pytest.approx(run[name]["loss"], rel=1e-6)
        assert run[f"mb4_{name}"]["grad_norm"] == pytest.approx(run[name]["grad_norm"], rel=1e-5)
    assert max_diff(run["mb4_params_step2"], run["params_step2"]) < 1e-5


def test_dcp_resume_reproduces_the_uninterrupted_step(run: dict[str, Any]) -> None:
    assert run["resumed_version"] == 1
    assert run["resumed_step2"] == run["step2"]
    assert max_diff(run["resumed_params_step2"], run["params_step2"]) == 0.0


def test_exported_weights_reload_in_transformers(run: dict[str, Any]) -> None:
    export = run["out"] / "export"
    assert run["update_weights"]["update_weights_seconds"] > 0
    saved = load_file(export / "model.safetensors")
    assert max_diff(saved, run["params_step2"]) == 0.0
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    ids, attn = run["batch1"]["input_ids"], run["batch1"]["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    mask = attn.bool()
    torch.testing.assert_close(run["export_logits"][mask], logits[mask], atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(export)
    assert len(tok) == len(AutoTokenizer.from_pretrained(run["model_dir"]))
    # HF save -> load into a sharded engine gives back the same weights
    assert max_diff(run["hf_loaded_params"], run["params_step2"]) == 0.0


def test_nan_loss_skips_the_step(run: dict[str, Any]) -> None:
    stats = run["nan_step"]
    assert stats["update_successful"] == 0.0
    assert math.isnan(stats["grad_norm"]) and math.isnan(stats["loss"])
    assert run["nan_params_max_change"] == 0.0
    assert run["nan_adam_step_delta"] == 0.0
    after = run["after_nan_step"]
    assert after["update_successful"] == 1.0 and math.isfinite(after["loss"])


def test_a_rank_without_rows_still_steps_in_lockstep(run: dict[str, Any]) -> None:
    stats = run["one_row_step"]
    assert stats["update_successful"] == 1.0 and stats["n_seqs"] == 1.0
    seq_len = run["batch1"]["input_ids"].shape[1]
    assert sorted(run["one_row_rows_and_forward_shapes"]) == [(0, (0, seq_len)),
                                                              (1, (1, seq_len))]


def test_mixed_precision_with_gradient_checkpointing(run: dict[str, Any]) -> None:
    stats = run["bf16_step1"]
    assert stats["update_successful"] == 1.0
    assert stats["loss"] == pytest.approx(run["step1"]["loss"], rel=2e-2)


def test_critic_values_and_training(run: dict[str, Any]) -> None:
    values, attn = run["critic_values"], run["batch1"]["attention_mask"]
    assert values.shape == attn.shape and values.dtype == torch.float32
    for b, ref in enumerate(_per_sequence(run, critic=True)):
        n = int(attn[b].sum())
        torch.testing.assert_close(values[b, :n].double(), ref["values"], atol=1e-5, rtol=0)
    assert run["critic_step1"]["update_successful"] == 1.0
    assert not torch.allclose(run["critic_values_after"], values)
