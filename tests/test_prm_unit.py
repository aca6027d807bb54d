"""Process rewards, unit level: step splitting, step-reward placement on each step's last
token, GAE over sparse step rewards against a float64 loop, and the epoch/mini-batch loop."""

from __future__ import annotations

import math

import pytest
import torch
from reward_fns import right_if_42
from tensordict import TensorDict

from areal_like.algorithms import CriticActor, PPOActor
from areal_like.api import ModelResponse
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.models.tiny import build_tokenizer
from areal_like.rewards.failures import GroupRewardFailure, RewardFailure
from areal_like.rewards.prm_steps import place_step_rewards, split_steps, step_end_tokens
from areal_like.utils.stats_tracker import StatsTracker
from workflows.prm import PRMWorkflow

WORKED = "47 + 38: 7 + 8 = 15, write 5, carry 1; 4 + 3 + 1 = 8, write 8 #### 85"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, seed=1)


def test_split_steps_keeps_delimiters_and_text():
    assert split_steps(WORKED, "; ") == ["47 + 38: 7 + 8 = 15, write 5, carry 1; ",
                                         "4 + 3 + 1 = 8, write 8 #### 85"]
    assert split_steps("a\nb\n", "\n") == ["a\n", "b\n"]  # no empty tail step
    assert split_steps("", "\n") == []
    for text in ("a\n\nb\n\n\nc", "\n\nx", "no delimiter"):
        assert "".join(split_steps(text, "\n\n")) == text
    with pytest.raises(ValueError, match="step_delimiter"):
        split_steps("x", "")


@pytest.mark.parametrize("text, delim", [(WORKED, "; "), ("step one\nstep two\nend", "\n"),
                                         ("a\n\nbb\n\nccc", "\n\n")])
def test_step_end_tokens_match_the_tokenizer_offsets(tok, text, delim):
    """Reference: the fast tokenizer's own char offsets of the same ids; the step's last
    token is the one whose span holds the step's last character."""
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    steps, positions = step_end_tokens(tok, ids + [tok.convert_tokens_to_ids("<|im_end|>")],
                                       delim)
    assert "".join(steps) == text
    char_end = 0
    for step, pos in zip(steps, positions, strict=True):
        char_end += len(step)
        expected = next(i for i, (a, b) in enumerate(offsets) if a < char_end <= b)
        assert pos == expected, (step, pos, expected, offsets)


def test_place_step_rewards():
    assert place_step_rewards(5, [1, 4], [0.25, -1.0]) == [0.0, 0.25, 0.0, 0.0, -1.0]
    assert place_step_rewards(3, [2, 2], [0.5, 0.25]) == [0.0, 0.0, 0.75]
    with pytest.raises(ValueError, match="outside"):
        place_step_rewards(3, [3], [1.0])
    with pytest.raises(ValueError, match="2 step scores for 1 steps"):
        place_step_rewards(3, [1], [1.0, 2.0])


def _resp(ids: list[int]) -> ModelResponse:
    return ModelResponse(input_tokens=[1, 2], output_tokens=ids, output_logprobs=[-0.5] * len(ids),
                         output_versions=[0] * len(ids))


def test_workflow_rows_put_scores_on_step_ends_and_exclude_failures(tok):
    wf = PRMWorkflow(right_if_42, _gconfig(), tok, None, "; ")
    ids = tok.encode(WORKED, add_special_tokens=False)
    _, positions = step_end_tokens(tok, ids, "; ")
    prompt = [5, 6, 7]
    dense = place_step_rewards(len(ids), positions, [0.9, 0.1])
    group = wf.rows(prompt, [_resp(ids)], [(dense, 2)], group_id=3)
    rewards = group["rewards"][0]
    assert rewards.shape == group["input_ids"][0].shape
    nonzero = torch.nonzero(rewards).flatten().tolist()
    assert nonzero == [len(prompt) + p for p in positions]
    assert rewards[nonzero].tolist() == pytest.approx([0.9, 0.1])
    assert bool(group["loss_mask"][0, nonzero].all()) and int(group["n_steps"][0]) == 2
    failure = RewardFailure("prm http://x/score", "timeout", "no answer")
    with pytest.raises(GroupRewardFailure) as info:
        wf.rows(prompt, [_resp(ids), _resp(ids)], [failure, (dense, 2)], group_id=3)
    assert info.value.failures == [failure] and info.value.survivors.batch_size[0] == 1


def _gconfig():
    from areal_like.api import GenerationHyperparameters

    return GenerationHyperparameters(n_samples=1, max_new_tokens=8)


class _RecordingEngine:
    """Records the rows of every optimizer step (rows are told apart by input_ids[:, 0])."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def train(self, mode: bool = True):
        return self

    def eval(self):
        return self

    def get_version(self) -> int:
        return 0

    def train_batch(self, batch, loss_fn, loss_weight_fn):
        self.steps.append(batch["input_ids"][:, 0].tolist())
        return {"loss": float(len(self.steps))}


def _sparse_batch(n_rows: int = 6, seed: int = 0) -> TensorDict:
    """Token-aligned rows: prompt of 2, completion of 3..7 tokens, step rewards on a few
    completion tokens, critic values [B, L] (next-token aligned)."""
    g = torch.Generator().manual_seed(seed)
    L = 9
    ids = torch.zeros(n_rows, L, dtype=torch.long)
    attn = torch.zeros(n_rows, L, dtype=torch.bool)
    mask = torch.zeros_like(attn)
    rewards = torch.zeros(n_rows, L)
    for i in range(n_rows):
        n = 2 + int(torch.randint(3, 8, (1,), generator=g))
        ids[i, :n] = torch.randint(3, 100, (n,), generator=g)
        ids[i, 0] = 1000 + i
        attn[i, :n], mask[i, 2:n] = True, True
        ends = sorted({int(t) for t in torch.randint(2, n, (2,), generator=g)} | {n - 1})
        rewards[i, ends] = torch.rand(len(ends), generator=g)
    return TensorDict({
        "input_ids": ids, "attention_mask": attn, "loss_mask": mask,
        "logprobs": torch.where(mask, -0.7, 0.0), "rewards": rewards,
        "prox_logp": torch.full((n_rows, L), -0.6),
        "values": torch.randn(n_rows, L, generator=g),
    }, batch_size=[n_rows])


def _gae_reference(batch: TensorDict, gamma: float, lam: float) -> list[list[float]]:
    """Plain-Python float64 GAE in token space: action j generates token j (loss_mask[j]),
    earns rewards[j], starts from V = values[j - 1]; the next action is the next trained
    token; after the last one V = 0. Result in next-token alignment (position j - 1)."""
    out = []
    for i in range(batch.batch_size[0]):
        m = batch["loss_mask"][i].tolist()
        r = [float(x) for x in batch["rewards"][i].double()]
        v = [float(x) for x in batch["values"][i].double()]
        row = [0.0] * len(m)
        acts = [j for j in range(len(m)) if m[j]]
        next_v = next_a = 0.0
        for j in reversed(acts):
            delta = r[j] + gamma * next_v - v[j - 1]
            a = delta + gamma * lam * next_a
            row[j - 1] = a
            next_v, next_a = v[j - 1], a
        out.append(row)
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_over_sparse_step_rewards_matches_a_float64_loop(gamma, lam):
    batch = _sparse_batch()
    cfg = algorithm_config(adv=dict(estimator="gae", discount=gamma, gae_lambda=lam), norm=dict(level="none"))
    prepared = PPOActor(_RecordingEngine(), cfg, tracker=StatsTracker()).compute_advantages(batch)
    ref = _gae_reference(batch, gamma, lam)
    got = prepared["advantages"].double().tolist()
    for i in range(len(ref)):
        assert got[i] == pytest.approx(ref[i], abs=1e-6, rel=1e-6)  # float32 output
    returns = prepared["returns"].double()
    vals = prepared["values"].double()
    m = prepared["loss_mask"]
    assert torch.allclose(returns[m], torch.tensor(ref, dtype=torch.float64)[m] + vals[m],
                          atol=1e-6)
    # with batch normalisation: population mean 0 and std 1 over the trained positions
    cfg_n = algorithm_config(adv=dict(estimator="gae", discount=gamma, gae_lambda=lam), norm=dict(level="batch", eps=0.0))
    norm = PPOActor(_RecordingEngine(), cfg_n, tracker=StatsTracker()).compute_advantages(batch)
    flat = [ref[i][t] for i in range(len(ref)) for t in range(len(ref[i])) if m[i, t]]
    mu = sum(flat) / len(flat)
    sd = math.sqrt(sum((x - mu) ** 2 for x in flat) / len(flat))
    assert norm["advantages"][m].double().tolist() == pytest.approx(
        [(x - mu) / sd for x in flat], abs=1e-5)


@pytest.mark.parametrize("epochs, n_mb", [(1, 1), (4, 2), (3, 4)])
def test_epochs_times_minibatches_optimizer_steps_each_row_once_per_epoch(epochs, n_mb):
    batch = _sparse_batch(n_rows=6)
    cfg = algorithm_config(adv=dict(estimator="gae"), update=dict(epochs=epochs, n_minibatches=n_mb))
    for actor_cls in (PPOActor, CriticActor):
        engine = _RecordingEngine()
        actor = actor_cls(engine, cfg, tracker=StatsTracker())
        prepared = PPOActor(_RecordingEngine(), cfg, tracker=StatsTracker()
                            ).compute_advantages(batch)
        stats = actor.update(prepared)
        assert len(engine.steps) == epochs * n_mb
        rows = [1000 + i for i in range(6)]
        for e in range(epochs):  # mini-batches in order, every row once per epoch
            epoch = engine.steps[e * n_mb:(e + 1) * n_mb]
            assert sorted(r for mb in epoch for r in mb) == rows
            assert [r for mb in epoch for r in mb] == rows
        assert stats["loss"] == pytest.approx((epochs * n_mb + 1) / 2)  # mean over all steps


def test_update_epochs_is_checked():
    with pytest.raises(ValueError, match="algorithm.update.epochs=0"):
        algorithm_config(update=dict(epochs=0))


class _FixedPRM:
    """Stands in for PRMClient inside this unit test only (the service is tested for real in
    test_prm_service.py)."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores

    async def score(self, prompt: str, steps: list[str],
                    images: list[str] | None = None) -> list[float]:
        assert len(steps) == len(self.scores)
        return self.scores


async def test_average_steps_and_outcome_reward(tok):
    ids = tok.encode(WORKED, add_special_tokens=False)
    _, positions = step_end_tokens(tok, ids, "; ")
    resp = _resp(ids)
    summed = PRMWorkflow(right_if_42, _gconfig(), tok, _FixedPRM([0.9, 0.5]), "; ")
    rewards, n = await summed.step_rewards("p", resp)
    assert n == 2 and [rewards[p] for p in positions] == [0.9, 0.5]
    averaged = PRMWorkflow(right_if_42, _gconfig(), tok, _FixedPRM([0.9, 0.5]), "; ",
                           average_steps=True, outcome_coef=2.0)
    rewards, n = await averaged.step_rewards("p", resp)
    assert [rewards[p] for p in positions] == pytest.approx([0.45, 0.25])
    offset = PRMWorkflow(right_if_42, _gconfig(), tok, _FixedPRM([0.9, 0.25]), "; ",
                         score_offset=0.5)
    off_rewards, _ = await offset.step_rewards("p", resp)
    assert [off_rewards[p] for p in positions] == pytest.approx([0.4, -0.25])
    with_outcome, _ = averaged.add_outcome((rewards, n), 1.0)
    assert with_outcome[-1] == pytest.approx(rewards[-1] + 2.0)
    assert with_outcome[:-1] == rewards[:-1]
    failure = RewardFailure("right_if_42", "raised", "boom")
    assert averaged.add_outcome((rewards, n), failure) is failure
    # a completion left with no token (a VLM's first sampled token was a vision token, cut
    # off): nothing carries a reward and nothing trains; its row stays in the group
    nothing = _resp([])
    assert await averaged.step_rewards("p", nothing) == ([], 0)
    assert averaged.add_outcome(([], 0), 1.0) == ([], 0)
    group = averaged.rows([5, 6], [resp, nothing], [(rewards, n), ([], 0)], group_id=1)
    assert group["loss_mask"][1].sum() == 0 and group["rewards"][1].abs().sum() == 0
