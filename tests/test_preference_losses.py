"""The preference losses as the engine runs them (a packed micro-batch of pairs) against float64
references written out here: Bradley-Terry's loss and its gradient in closed form, DPO
(sigmoid, label-smoothed, IPO, + SFT term) through an independent float64 log-softmax; and the
engine keeping each pair in one micro-batch whatever its token budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from areal_like.algorithms.actors.preference import DPOActor, RewardModelActor, pairs_in
from areal_like.algorithms.preference import response_logprobs
from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.preference_config import DPOLossConfig, RewardModelLossConfig
from areal_like.data.preference import PreferencePair, build_pair_batch
from areal_like.utils.packed_logprobs import next_token_logprobs
from areal_like.utils.stats_tracker import StatsTracker
from engines.fsdp.packing import loss_group_units, pack_sequences

GEN = torch.Generator().manual_seed(7)


def _pairs(n: int, vocab: int = 50) -> list[PreferencePair]:
    def ids(k: int) -> list[int]:
        return torch.randint(3, vocab, (k,), generator=GEN).tolist()

    return [PreferencePair(ids(3 + i % 3), ids(2 + i % 4), ids(1 + (i + 1) % 5),
                           margin=0.25 * i, source=f"test[{i}]") for i in range(n)]


def _packed(batch: TensorDict) -> TensorDict:
    return pack_sequences(batch, list(range(batch.shape[0])))


def test_bradley_terry_loss_and_gradient_equal_the_closed_form() -> None:
    batch = build_pair_batch(_pairs(5))
    mb = _packed(batch)
    n_tokens = mb["input_ids"].shape[0]
    values = torch.randn(n_tokens, 1, generator=GEN, dtype=torch.float64).float()
    values.requires_grad_(True)
    config = RewardModelLossConfig(margin_scale=0.5)
    loss = RewardModelActor(None, config, StatsTracker()).loss_fn()(values, mb)  # type: ignore[arg-type]
    loss.backward()

    v = values.detach().double()[:, 0]
    last = mb["cu_seqlens"][1:] - 1
    r_c, r_r = v[last[0::2]], v[last[1::2]]
    m = 0.5 * mb["margin"][0::2].double()
    d = r_c - r_r - m
    n = d.numel()
    expected = torch.log1p(torch.exp(-d)).mean()
    assert abs(float(loss.detach()) - float(expected)) < 1e-6
    # d loss / d r_c = -sigmoid(-d) / n, d loss / d r_r = +sigmoid(-d) / n, 0 elsewhere
    grad = torch.zeros(n_tokens, dtype=torch.float64)
    s = torch.sigmoid(-d)
    grad[last[0::2]] = -s / n
    grad[last[1::2]] = s / n
    assert torch.allclose(values.grad.double()[:, 0], grad, atol=1e-7, rtol=1e-5)
    assert pairs_in(mb) == 5


def _reference_dpo(logits: torch.Tensor, mb: TensorDict, ref: torch.Tensor,
                   config: DPOLossConfig) -> torch.Tensor:
    """DPO in float64 from the logits up, written without the code under test."""
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    cu, ids = mb["cu_seqlens"].tolist(), mb["input_ids"]
    mask = mb["loss_mask"].bool()
    sums, counts = [], []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        total, count = logits.new_zeros((), dtype=torch.float64), 0
        for t in range(s, e - 1):  # position t predicts token t + 1
            if mask[t]:
                total = total + logp_all[t, ids[t + 1]]
                count += 1
        sums.append(total)
        counts.append(count)
    pol = torch.stack(sums)
    ref = ref.double()
    n = torch.tensor(counts, dtype=torch.float64)
    if config.loss_type == "ipo":
        h = (pol[0::2] / n[0::2] - ref[0::2] / n[0::2]) - (pol[1::2] / n[1::2] - ref[1::2] / n[1::2])
        per_pair = (h - 1 / (2 * config.beta)) ** 2
    else:
        h = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
        eps = config.label_smoothing
        per_pair = (-(1 - eps) * torch.log(torch.sigmoid(config.beta * h))
                    - eps * torch.log(torch.sigmoid(-config.beta * h)))
    loss = per_pair.mean()
    if config.sft_coef:
        loss = loss + config.sft_coef * (-pol[0::2] / n[0::2]).mean()
    return loss


@pytest.mark.parametrize("config", [
    DPOLossConfig(beta=0.1),
    DPOLossConfig(beta=0.5, label_smoothing=0.2),
    DPOLossConfig(beta=0.3, loss_type="ipo"),
    DPOLossConfig(beta=0.2, sft_coef=0.5),
], ids=["sigmoid", "label_smoothing", "ipo", "rpo"])
def test_dpo_loss_and_gradient_equal_a_float64_reference(config: DPOLossConfig) -> None:
    vocab = 50
    batch = build_pair_batch(_pairs(4, vocab))
    batch["ref_logp"] = torch.randn(batch.shape[0], generator=GEN) * 3 - 8
    mb = _packed(DPOActor.prepare(batch))
    logits = torch.randn(mb["input_ids"].shape[0], vocab, generator=GEN, dtype=torch.float64)
    ours_in = logits.float().requires_grad_(True)
    loss = DPOActor(None, config, StatsTracker()).loss_fn()(ours_in, mb)  # type: ignore[arg-type]
    loss.backward()
    ref_in = logits.float().double().requires_grad_(True)
    expected = _reference_dpo(ref_in, mb, mb["ref_logp"], config)
    expected.backward()
    assert abs(float(loss.detach()) - float(expected)) < 1e-5 * max(1.0, abs(float(expected)))
    assert torch.allclose(ours_in.grad.double(), ref_in.grad, atol=1e-6, rtol=1e-4)


def test_dpo_loss_is_log_two_where_the_policy_is_its_reference() -> None:
    batch = build_pair_batch(_pairs(3))
    mb = _packed(DPOActor.prepare(batch))
    logits = torch.randn(mb["input_ids"].shape[0], 50, generator=GEN)
    # the reference's log-probs are the policy's own: h = 0
    mb["ref_logp"], _ = response_logprobs(next_token_logprobs(logits, mb), mb["loss_mask"],
                                          mb["cu_seqlens"])
    loss = DPOActor(None, DPOLossConfig(), StatsTracker()).loss_fn()(logits, mb)  # type: ignore[arg-type]
    assert abs(float(loss) - math.log(2)) < 1e-6


def test_a_micro_batch_that_is_not_pairs_is_refused() -> None:
    mb = _packed(build_pair_batch(_pairs(2)))
    mb["is_chosen"] = torch.tensor([True, True, False, False])
    with pytest.raises(ValueError, match="not \\(chosen, rejected\\) pairs"):
        RewardModelActor(None, RewardModelLossConfig(), StatsTracker()).loss_fn()(  # type: ignore[arg-type]
            torch.zeros(mb["input_ids"].shape[0], 1), mb)


def test_the_engine_keeps_each_pair_in_one_micro_batch(tiny_model_dir: Path) -> None:
    from engines import FSDPEngine

    pairs = _pairs(6)
    batch = build_pair_batch(pairs)
    assert loss_group_units(batch) == [[2 * i, 2 * i + 1] for i in range(6)]
    longest_pair = max(len(p.prompt_ids) * 2 + len(p.chosen_ids) + len(p.rejected_ids)
                       for p in pairs)
    losses = {}
    for budget in (longest_pair, 4096):  # one pair per micro-batch or so, and all in one
        engine = FSDPEngine(TrainEngineConfig(
            model=ModelConfig(path=str(tiny_model_dir), is_critic=True),
            optimizer=OptimizerConfig(lr=1e-3), mb_spec=MicroBatchSpec(max_tokens_per_mb=budget)))
        engine.initialize()
        try:
            rm = RewardModelActor(engine, RewardModelLossConfig(), StatsTracker())
            stats = engine.eval_batch(batch, rm.loss_fn(), pairs_in)
            losses[budget] = (stats["loss"], stats["n_mbs"])
            if budget == longest_pair:  # one token less: the longest pair fits nowhere
                engine.config.mb_spec.max_tokens_per_mb = budget - 1
                with pytest.raises(ValueError, match="a loss group's rows count together"):
                    engine.eval_batch(batch, rm.loss_fn(), pairs_in)
        finally:
            engine.destroy()
    (split_loss, split_mbs), (whole_loss, whole_mbs) = losses[longest_pair], losses[4096]
    assert split_mbs > 1 and whole_mbs == 1
    assert abs(split_loss - whole_loss) < 1e-6



def test_a_lora_actors_reference_is_its_own_frozen_base(tiny_model_dir: Path) -> None:
    """DPO with actor.lora: the reference log-probs come from the actor's base with its
    adapters off: the untouched model's, before and after the adapters train."""
    from areal_like.api.lora_config import LoRAConfig
    from engines import FSDPEngine

    batch = build_pair_batch(_pairs(4))

    def engine(lora: int) -> FSDPEngine:
        made = FSDPEngine(TrainEngineConfig(
            model=ModelConfig(path=str(tiny_model_dir)), lora=LoRAConfig(rank=lora),
            optimizer=OptimizerConfig(lr=5e-2)))
        made.initialize()
        return made

    plain = engine(0)
    original = DPOActor.response_logprobs(plain, batch)
    plain.destroy()
    actor = engine(4)
    try:
        base = actor.base_model_view()
        assert torch.allclose(DPOActor.response_logprobs(base, batch), original, atol=1e-5)
        batch["ref_logp"] = DPOActor.response_logprobs(base, batch)
        dpo = DPOActor(actor, DPOLossConfig(beta=0.5), StatsTracker())
        first = dpo.update(batch)["loss"]
        assert abs(first - math.log(2)) < 1e-6  # adapters start at zero: policy = reference
        for _ in range(3):
            dpo.update(batch)
        trained = DPOActor.response_logprobs(actor, batch)
        assert (trained - original).abs().max() > 1e-3  # the adapters moved the policy ...
        # ... and not its base, the reference
        assert torch.allclose(DPOActor.response_logprobs(base, batch), original, atol=1e-5)
    finally:
        actor.destroy()


def test_online_dpo_pairs_each_groups_best_with_its_worst() -> None:
    from recipes.online_dpo import best_and_worst

    ids = torch.arange(6 * 5).reshape(6, 5)
    batch = TensorDict({
        "input_ids": ids, "attention_mask": torch.ones(6, 5, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1]] * 6, dtype=torch.bool),
        "rewards": torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 2.0]),  # group 1 tied: no pair
        "group_id": torch.tensor([7, 7, 7, 3, 3, 3]),
    }, batch_size=[6])
    pairs = best_and_worst(batch, group_size=3)
    assert pairs["input_ids"].tolist() == [ids[1].tolist(), ids[0].tolist()]
    assert pairs["is_chosen"].tolist() == [True, False]
    assert pairs["loss_group_id"].tolist() == [0, 0]
    # dense rewards are summed per sequence; without group ids, runs of group_size rows
    dense = batch.exclude("group_id")
    dense["rewards"] = torch.tensor([[0.0, 0, 0, 0, 3], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0],
                                     [0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    pairs = best_and_worst(dense, group_size=3)
    assert pairs["input_ids"][0::2].tolist() == [ids[0].tolist(), ids[4].tolist()]
    assert pairs["input_ids"][1::2].tolist() == [ids[2].tolist(), ids[3].tolist()]
