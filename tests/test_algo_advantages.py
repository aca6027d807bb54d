"""Advantage estimators against plain-loop float64 references, and the estimator registry."""

from __future__ import annotations

import math

import pytest
import torch

from areal_like.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    broadcast_to_tokens,
    get_advantage_estimator,
    register_advantage_estimator,
)
from areal_like.algorithms.advantages import discounted_returns, gae_advantages
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.api.config import AlgorithmConfig

TOL = dict(rtol=1e-10, atol=1e-10)


def _ref_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the trained positions backwards (untrained ones are skipped)."""
    b, n = len(rewards), len(rewards[0])
    adv = [[0.0] * n for _ in range(b)]
    ret = [[0.0] * n for _ in range(b)]
    for i in range(b):
        pos = [t for t in range(n) if mask[i][t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            a = delta + gamma * lam * next_a
            adv[i][t], ret[i][t] = a, a + values[i][t]
            next_v, next_a = values[i][t], a
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _random_dense(seed, b=6, n=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) > 0.35  # holes = untrained turns of an agent
    mask[0] = False  # a sequence without trained tokens
    rewards = torch.where(mask & (torch.rand(b, n, generator=g) > 0.6),
                          torch.randn(b, n, generator=g, dtype=torch.float64), 0.0)
    values = torch.randn(b, n, generator=g, dtype=torch.float64)
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_with_dense_rewards_at_arbitrary_positions(gamma, lam):
    rewards, values, mask = _random_dense(0)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    want_adv, want_ret = _ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)
    zeros = [[0.0] * 9 for _ in range(6)]
    want_g, _ = _ref_gae(rewards.tolist(), zeros, mask.tolist(), gamma, 1.0)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), want_g, **TOL)


def _inputs(seq_rewards, groups, mask=None, **kw):
    seq = torch.tensor(seq_rewards, dtype=torch.float64)
    b = seq.shape[0]
    mask = torch.ones(b, 4, dtype=torch.bool) if mask is None else mask
    token = torch.zeros(b, 4, dtype=torch.float64)
    token[:, -1] = seq
    return AdvantageInputs(token_rewards=token, seq_rewards=seq, loss_mask=mask,
                           group_index=torch.tensor(groups), **kw)


def _group_ref(r, groups, kind, eps=1e-5):
    out = []
    for i, gi in enumerate(groups):
        members = [r[j] for j in range(len(r)) if groups[j] == gi]
        mu = sum(members) / len(members)
        sigma = math.sqrt(sum((x - mu) ** 2 for x in members) / len(members))
        if max(members) == min(members):
            out.append(0.0)
        elif kind == "grpo":
            out.append((r[i] - mu) / (sigma + eps))
        elif kind == "dr_grpo":
            out.append(r[i] - mu)
        elif kind == "rloo":
            others = [r[j] for j in range(len(r)) if groups[j] == gi and j != i]
            out.append(r[i] - sum(others) / len(others))
    return out


REWARDS = [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 2.0, -1.0, 0.5, 0.7]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3]  # group 1: all equal; group 2: single sample


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_match_reference_and_never_nan(name):
    cfg = AlgorithmConfig()
    out = get_advantage_estimator(name)(_inputs(REWARDS, GROUPS), cfg)
    want = _group_ref(REWARDS, GROUPS, name, cfg.norm.eps)
    got = out.advantages
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64)[:, None].expand(-1, 4),
                               **TOL)
    assert (got[4:8] == 0).all()  # all-equal group and single-sample group: exactly zero


def test_group_estimators_broadcast_only_to_trained_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]]).bool()
    out = get_advantage_estimator("dr_grpo")(_inputs([1.0, 0.0], [0, 0], mask), AlgorithmConfig())
    assert out.advantages.tolist() == [[0, 0.5, 0.5, 0], [0, 0, -0.5, -0.5]]


def test_remax_and_cpgd():
    cfg = algorithm_config(filters=dict(clip_filter_max_weight=3.0))
    base = torch.tensor([0.5] * len(REWARDS), dtype=torch.float64)
    out = get_advantage_estimator("remax")(_inputs(REWARDS, GROUPS, baseline_rewards=base), cfg)
    torch.testing.assert_close(out.advantages[:, 0],
                               torch.tensor(REWARDS, dtype=torch.float64) - 0.5, **TOL)
    # without a baseline key: plain REINFORCE on the outcome, A = r
    out = get_advantage_estimator("remax")(_inputs(REWARDS, GROUPS), cfg)
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor(REWARDS, dtype=torch.float64))
    with pytest.raises(ValueError, match="baseline_rewards"):
        get_advantage_estimator("remax")(_inputs(REWARDS, GROUPS, baseline_rewards=base[:3]), cfg)

    out = get_advantage_estimator("cpgd")(_inputs(REWARDS, GROUPS), cfg)
    centred = _group_ref(REWARDS, GROUPS, "dr_grpo")
    # 4 groups, 2 flat (groups 1 and 2): varied groups weigh 4 / 2 = 2, flat ones 1 (their
    # centred rewards are 0 anyway)
    want = [c * (2.0 if g in (0, 3) else 1.0) for c, g in zip(centred, GROUPS, strict=True)]
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor(want, dtype=torch.float64),
                               **TOL)


def test_reinforce_and_reinforce_pp_use_dense_rewards():
    rewards, values, mask = _random_dense(4)
    cfg = algorithm_config(adv=dict(discount=0.9))
    inputs = AdvantageInputs(token_rewards=rewards, seq_rewards=rewards.sum(-1), loss_mask=mask,
                             group_index=torch.arange(6))
    zeros = [[0.0] * 9 for _ in range(6)]
    want_g, _ = _ref_gae(rewards.tolist(), zeros, mask.tolist(), 0.9, 1.0)
    out = get_advantage_estimator("reinforce")(inputs, cfg)
    torch.testing.assert_close(out.advantages, want_g, **TOL)
    out = get_advantage_estimator("reinforce_pp")(inputs, cfg)
    vals = [float(want_g[i, t]) for i in range(6) for t in range(9) if mask[i, t]]
    mu = sum(vals) / len(vals)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
    want = torch.where(mask, (want_g - mu) / (sigma + cfg.norm.eps), 0.0)
    torch.testing.assert_close(out.advantages, want, **TOL)
    torch.testing.assert_close(out.returns, want_g, **TOL)


def test_gae_estimator_requires_values():
    rewards, values, mask = _random_dense(5)
    inputs = AdvantageInputs(token_rewards=rewards, seq_rewards=rewards.sum(-1), loss_mask=mask,
                             group_index=torch.arange(6))
    with pytest.raises(ValueError, match="values"):
        get_advantage_estimator("gae")(inputs, AlgorithmConfig())
    inputs.values = values
    out = get_advantage_estimator("gae")(inputs, algorithm_config(adv=dict(discount=0.95, gae_lambda=0.9)))
    want_adv, want_ret = _ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.9)
    torch.testing.assert_close(out.advantages, want_adv, **TOL)
    torch.testing.assert_close(out.returns, want_ret, **TOL)


def test_registry_decorator_lookup_and_errors():
    @register_advantage_estimator("test_const_baseline")
    def const_baseline(inputs, config):
        return AdvantageOutputs(broadcast_to_tokens(inputs.seq_rewards - 0.5, inputs.loss_mask))

    try:
        assert get_advantage_estimator("test_const_baseline") is const_baseline
        out = get_advantage_estimator("test_const_baseline")(_inputs([1.0, 0.0], [0, 1]),
                                                             AlgorithmConfig())
        assert out.advantages[:, 0].tolist() == [0.5, -0.5]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_const_baseline")(lambda i, c: None)
        register_advantage_estimator("test_const_baseline", override=True)(const_baseline)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_const_baseline")
    with pytest.raises(KeyError, match="grpo"):
        get_advantage_estimator("test_const_baseline")
