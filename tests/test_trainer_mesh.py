"""The trainer's device mesh under a real `torchrun --nproc_per_node=4` on CPU (gloo): Ulysses
sequence parallelism (SP = 2 x 2 data-parallel ranks, SP = 4), tensor parallelism with FSDP
(TP = 2 x 2) and both (TP = 2 x SP = 2, with activation checkpointing of every other layer),
each against a single-process float64 forward and
backward of the same batches (tests/fsdp_reference.py). One launch of tests/mesh_worker.py
runs every layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_reference import max_diff, per_sequence_outputs, reference_steps
from safetensors.torch import load_file
from torchrun_helpers import run_worker

from areal_like.api.lora_config import LoRAConfig

pytestmark = [pytest.mark.torchrun, pytest.mark.e2e]

LAYOUTS = ("sp2", "sp4", "tp2", "tp2sp2", "lora_sp2")
SEQUENCE_PARALLEL = ("sp2", "sp4", "tp2sp2", "lora_sp2")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ulysses_worker")
    res = run_worker("mesh_worker.py", tiny_model_dir, out, nproc=4)
    res["out"], res["model_dir"] = out, tiny_model_dir
    return res


@pytest.fixture(scope="module")
def references(run: dict[str, Any]) -> dict[str, tuple[list, list, list]]:
    """Full training, and LoRA's (the worker's adapters: rank 4, alpha 8, A seeded as the
    engine seeds it), of the same batches."""
    batches = [run["batch1"], run["batch2"]]
    return {"full": reference_steps(run["model_dir"], batches),
            "lora": reference_steps(run["model_dir"], batches, lora=LoRAConfig(rank=4, alpha=8))}


def test_the_mesh_splits_four_ranks_into_data_sequence_and_tensor(run: dict[str, Any]) -> None:
    assert run["world_size"] == 4
    # rank 0's coordinates: data rank 0 of what the sequence and tensor sizes leave
    assert [run[name]["dp"] for name in LAYOUTS] == [(0, 2), (0, 1), (0, 2), (0, 1), (0, 2)]
    # the 1m model's 4 decoder layers: every other one recomputed in tp2sp2's backward
    assert [run[name]["checkpointed_layers"] for name in LAYOUTS] == [0, 0, 0, 2, 0]


@pytest.mark.parametrize("layout", SEQUENCE_PARALLEL)
def test_the_batches_exercise_padding_and_boundaries_inside_chunks(run: dict[str, Any],
                                                                   layout: str) -> None:
    sp = 4 if layout == "sp4" else 2
    splits = run[layout]["splits"]
    assert any(len(cu) > 2 for cu, _ in splits)  # packs of several sequences
    assert any(padding > 0 for _, padding in splits)  # an odd-length pack
    assert any(b % -(-cu[-1] // sp) for cu, _ in splits for b in cu[1:-1])  # a sequence
    # ends inside a rank's chunk


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_log_probs_and_entropy_equal_the_single_rank_float64_forward(
        run: dict[str, Any], layout: str) -> None:
    out, attn = run[layout]["forward"], run["batch1"]["attention_mask"]
    for b, ref in enumerate(per_sequence_outputs(run["model_dir"], run["batch1"])):
        n = int(attn[b].sum())
        torch.testing.assert_close(out[b, :n - 1, 0].double(), ref["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[b, :n, 1].double(), ref["entropy"], atol=1e-5, rtol=0)
        assert (out[b, n - 1:, 0] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_gradients_and_steps_equal_the_single_rank_float64_training(
        run: dict[str, Any], references: dict[str, tuple[list, list, list]],
        layout: str) -> None:
    ref_stats, ref_params, ref_grads = references["lora" if "lora" in layout else "full"]
    got = run[layout]
    for i in range(2):
        stats = got[f"step{i + 1}"]
        assert stats["update_successful"] == 1.0
        assert stats["loss"] == pytest.approx(ref_stats[i]["loss"], rel=1e-5)
        assert stats["grad_norm"] == pytest.approx(ref_stats[i]["grad_norm"], rel=1e-5)
        # every token counted once, not once per rank of a sequence-parallel group
        batch = run[f"batch{i + 1}"]
        assert stats["n_tokens"] == int(batch["attention_mask"].sum())
        assert stats["n_seqs"] == batch["input_ids"].shape[0]
        assert len(got["grads"][i]) == len(ref_grads[i])
        assert max_diff(got["grads"][i], ref_grads[i]) < 2e-6
        # the check is meaningful: gradients are far from zero at this tolerance
        assert max(float(g.abs().max()) for g in ref_grads[i].values()) > 1e-2
    assert max_diff(got["params"], ref_params[1]) < 1e-5
    assert max_diff(got["params"], ref_params[0]) > 1e-3


def test_a_checkpoint_of_a_split_layout_resumes_exactly(run: dict[str, Any]) -> None:
    """TP = 2 x SP = 2 (weights sharded on two meshes): a DCP checkpoint written beside step 2
    holds step 1's state; a fresh engine that loads it takes step 2 exactly as it was taken."""
    got = run["tp2sp2"]
    assert got["resumed_step2"] == got["step2"]
    assert max_diff(got["resumed_params"], got["params"]) == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_statistics_a_loss_records_count_each_token_once(run: dict[str, Any],
                                                         layout: str) -> None:
    for i in range(2):
        batch = run[f"batch{i + 1}"]
        trained = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).sum()
        assert run[layout][f"recorded{i + 1}"]["n_trained"] == int(trained)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fleet_receives_the_trained_full_tensors(run: dict[str, Any], layout: str) -> None:
    """Disk (the HF folder; a LoRA run's adapter folder) and the process-group transport's
    buckets (a LoRA run's adapter in memory), from every layout."""
    params = run[layout]["params"]
    if "lora" in layout:  # PEFT's saved names: no adapter name inside
        adapter = run[layout]["adapter"]
        trained = {k.replace(".default.", "."): v for k, v in params.items() if "lora_" in k}
        assert len(adapter) == 4 * 7 * 2 and max_diff(adapter, trained) == 0.0
        saved = load_file(run["out"] / f"export_{layout}" / "adapter_model.safetensors")
        assert max_diff(saved, adapter) == 0.0
        return
    saved = load_file(run["out"] / f"export_{layout}" / "model.safetensors")
    assert max_diff({k: saved[k] for k in params}, params) == 0.0
    buckets = run[layout]["buckets"]
    assert max_diff({k: buckets[k] for k in params if k in buckets},
                    {k: params[k] for k in params if k in buckets}) == 0.0
    assert len(buckets) >= len(params) - 1  # (a tied head is served once)


def test_critic_values_gathered_back_equal_the_single_rank_values(run: dict[str, Any]) -> None:
    values, attn = run["critic_values"], run["batch1"]["attention_mask"]
    refs = per_sequence_outputs(run["model_dir"], run["batch1"], run["out"] / "critic_export")
    for b, ref in enumerate(refs):
        n = int(attn[b].sum())
        torch.testing.assert_close(values[b, :n].double(), ref["values"], atol=1e-5, rtol=0)


# The long-answer workload: answers of up to 64 tokens (a 1m model's answers run to the limit),
# so each packed micro-batch is long and every rank's chunk cuts through several answers.
LONG_ANSWERS = ["gconfig.max_new_tokens=64"]


@pytest.mark.sglang
def test_grpo_on_sequence_and_tensor_parallel_ranks_learns_as_the_single_rank_run(
        sglang_fleet, tiny_model_dir, tmp_path):
    """recipes/grpo.py at eta = 0, same seeds: one trainer process against four ranks that
    split every micro-batch's tokens (SP = 2) and every layer's heads and MLP (TP = 2): one
    data-parallel rank, the same batches. The servers sample with seeds and load every
    update from the split layout, so weights that differed beyond float round-off would change
    tokens, rewards and every statistic; they agree within float tolerance, and the servers'
    log-probs equal the trainer's (the train/inference gap at version lag 0)."""
    from test_recipes import EQUIVALENCE, _compared, _run_recipe
    from test_weight_broadcast import run_ranks

    single = _run_recipe("grpo", sglang_fleet, tiny_model_dir, tmp_path / "sp1", *EQUIVALENCE,
                         *LONG_ANSWERS, steps=3)
    split = run_ranks(sglang_fleet, tiny_model_dir, tmp_path / "tp2sp2", *LONG_ANSWERS,
                      "actor.parallel.sequence_parallel_size=2",
                      "actor.parallel.tensor_parallel_size=2", nproc=4)
    assert [r["step"] for r in split] == [0, 1, 2, 3]
    assert split[-1]["n_tokens"] > 8 * 50  # long answers: the packs really are long
    # the main job forwards shared prompts once; Ulysses packs whole instead (same numbers)
    assert "actor/update/n_forwarded_tokens" in single[-1]
    assert "actor/update/n_forwarded_tokens" not in split[-1]
    a = [{k: v for k, v in _compared(r).items() if not k.endswith("n_forwarded_tokens")}
         for r in single]
    b = [_compared(r) for r in split]
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        far = {k: (ra[k], rb[k]) for k in ra if rb[k] != pytest.approx(ra[k], rel=1e-4,
                                                                       abs=1e-5)}
        assert not far, (ra["step"], far)
    assert a[-1]["actor/update/entropy/avg"] > 0 and a[1]["loss"] != a[-1]["loss"]
    # every step after the first trained on tokens the servers sampled from weights they
    # loaded from the split layout: their log-probs are the trainer's
    assert all(r["actor/gap/lag0/abs_log_diff/max"] < 1e-4 for r in split[2:])
