"""LightRFT's experience maker (seed 002): every estimator under the seed's name, the group std
(unbiased like the seed, or population), k1/k3 KL with a fixed or adaptive coefficient, each
against a float64 reference written here in plain Python.

Tolerances: estimator outputs are float64 end to end, compared at 1e-12; advantages that pass
through PPOActor's float32 prepared batch at 2e-5 (float32 rounding of values of order 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_algo_ref_engine import RefEngine, _batch, _model, _true_logprobs

from areal_like.algorithms import PPOActor, estimator_traits, get_advantage_estimator
from areal_like.algorithms.estimators import AdvantageInputs
from areal_like.algorithms.kl_controller import KLController
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.utils.stats_tracker import StatsTracker

ON_POLICY = dict(group_size=4, off_policy=dict(decoupled=False, recompute_logprob=False))
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, 0.5, 0.7]  # group 1 is flat
GROUPS = [0] * 4 + [1] * 4 + [2] * 4
EPS = 1e-8  # the seed's epsilon


def _mean(xs):
    total = 0.0
    for x in xs:
        total += x
    return total / len(xs)


def _std(xs, unbiased):
    mu = _mean(xs)
    sq = 0.0
    for x in xs:
        sq += (x - mu) ** 2
    return math.sqrt(sq / (len(xs) - (1 if unbiased else 0)))


def _members(i):
    return [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i]]


def _inputs(lengths=(3, 1, 4, 2, 2, 3, 1, 4, 2, 2, 3, 1), L=5):
    """Outcome rewards at each row's last token of a left-aligned response."""
    b = len(REWARDS)
    mask = torch.zeros(b, L, dtype=torch.bool)
    tok = torch.zeros(b, L, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        tok[i, n - 1] = REWARDS[i]
    return AdvantageInputs(token_rewards=tok, seq_rewards=torch.tensor(REWARDS, dtype=torch.float64),
                           loss_mask=mask, group_index=torch.tensor(GROUPS))


@pytest.mark.parametrize("name", ["grpo", "group_norm"])
@pytest.mark.parametrize("group_std", ["unbiased", "population"])
def test_group_norm_std_is_selectable(name, group_std):
    """Seed: (r - mean) / (r.std(1) + eps) with torch's unbiased std; ours also population."""
    cfg = algorithm_config(adv=dict(estimator=name, group_std=group_std), norm=dict(eps=EPS))
    inp = _inputs()
    out = get_advantage_estimator(name)(inp, cfg).advantages
    for i in range(len(REWARDS)):
        m = _members(i)
        sd = _std(m, unbiased=group_std == "unbiased")
        want = 0.0 if max(m) == min(m) else (REWARDS[i] - _mean(m)) / (sd + EPS)
        for t in range(5):
            expect = want if inp.loss_mask[i, t] else 0.0
            assert float(out[i, t]) == pytest.approx(expect, abs=1e-12)
    # the two conventions differ by sqrt(n / (n - 1)) on a non-flat group of n = 4
    if group_std == "unbiased":
        pop = get_advantage_estimator(name)(inp, algorithm_config(adv=dict(estimator=name), norm=dict(eps=0.0))).advantages
        ratio = float(pop[0, 0]) / float(out[0, 0])
        assert ratio == pytest.approx(math.sqrt(4 / 3), rel=1e-6)
    assert estimator_traits(name).group_based and estimator_traits(name).kl_placement == "outcome"


def test_rloo_cpgd_reinforce_gae_as_the_seed_computes_them():
    inp = _inputs()
    b = len(REWARDS)
    # rloo: r - (sum_g r - r) / (n - 1)
    out = get_advantage_estimator("rloo")(inp, algorithm_config(adv=dict(estimator="rloo"))).advantages
    for i in range(b):
        m = _members(i)
        want = REWARDS[i] - (sum(m) - REWARDS[i]) / (len(m) - 1)
        assert float(out[i, 0]) == pytest.approx(want, abs=1e-12)
    # cpgd: (r - mean_g) * clip-filter weight (flat groups lambda = 1, others min(G/(G-Gf), 3))
    out = get_advantage_estimator("cpgd")(inp, algorithm_config(adv=dict(estimator="cpgd"))).advantages
    w = min(3 / (3 - 1), 3.0)
    for i in range(b):
        m = _members(i)
        want = 0.0 if max(m) == min(m) else (REWARDS[i] - _mean(m)) * w
        assert float(out[i, 0]) == pytest.approx(want, abs=1e-12)
    # reinforce: cumulative discounted returns of the token rewards (seed's loop)
    gamma = 0.9
    cfg = algorithm_config(adv=dict(estimator="reinforce", discount=gamma))
    out = get_advantage_estimator("reinforce")(inp, cfg).advantages
    for i in range(b):
        ret = 0.0
        for t in reversed(range(5)):
            r = float(inp.token_rewards[i, t]) if inp.loss_mask[i, t] else 0.0
            ret = r + gamma * ret
            if inp.loss_mask[i, t]:
                assert float(out[i, t]) == pytest.approx(ret, abs=1e-12)
    # gae: the seed's recursion over masked values and rewards
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(b, 5, generator=gen, dtype=torch.float64)
    inp.values = values
    lam = 0.8
    cfg = algorithm_config(adv=dict(estimator="gae", discount=gamma, gae_lambda=lam))
    got = get_advantage_estimator("gae")(inp, cfg)
    for i in range(b):
        v = [float(values[i, t]) if inp.loss_mask[i, t] else 0.0 for t in range(5)]
        r = [float(inp.token_rewards[i, t]) if inp.loss_mask[i, t] else 0.0 for t in range(5)]
        last = 0.0
        for t in reversed(range(5)):
            nxt = v[t + 1] if t < 4 else 0.0
            last = r[t] + gamma * nxt - v[t] + gamma * lam * last
            if inp.loss_mask[i, t]:
                assert float(got.advantages[i, t]) == pytest.approx(last, abs=1e-12)
                assert float(got.returns[i, t]) == pytest.approx(last + v[t], abs=1e-12)


def test_kl_controller_fixed_and_adaptive_trajectories():
    fixed = KLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        assert fixed.update(kl, 64) == 0.05
    target, horizon, n = 0.1, 500, 64
    ctl = KLController(0.05, target=target, horizon=horizon)
    observed = [0.30, 0.12, 0.10, 0.05, 0.0, 0.02, 0.5]  # clip +0.2, +0.2, 0, -0.5 -> -0.2 ...
    beta = 0.05
    for kl in observed:
        err = kl / target - 1.0
        err = 0.2 if err > 0.2 else (-0.2 if err < -0.2 else err)
        beta = beta * (1.0 + err * n / horizon)
        assert ctl.update(kl, n) == pytest.approx(beta, rel=1e-15)
    assert ctl.n_updates == len(observed)
    restored = KLController(0.05, target=target, horizon=horizon)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.n_updates == ctl.n_updates
    with pytest.raises(ValueError, match="kl_horizon"):
        KLController(0.1, target=0.1, horizon=10).update(0.0, 64)
    with pytest.raises(ValueError, match=r"algorithm.kl.coef=0.0 .*with target set"):
        algorithm_config(kl=dict(coef=0.0, target=0.1))
    with pytest.raises(ValueError, match="group_std"):
        algorithm_config(adv=dict(group_std="sample"))


def _kl_ref(model, ref_model, batch, i, estimator):
    """[(t, KL_t)] over the trained tokens of row i, from the behaviour log-probs."""
    n = int(batch["attention_mask"][i].sum())
    ref_lp = _true_logprobs(ref_model, batch["input_ids"][i], n)
    out = []
    for t in range(n):
        if batch["loss_mask"][i, t]:
            d = float(batch["logprobs"][i, t]) - float(ref_lp[t])
            out.append((t, d if estimator == "k1" else math.exp(-d) - 1.0 + d))
    return out


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reinforce_baseline_with_adaptive_kl_in_reward(tiny_model_dir, estimator):
    """Seed: r - mean_g r at the last token, -beta * KL_t on every token, cumulative returns,
    whitened over all trained tokens of the batch; beta adapts after each update."""
    model, ref_model = _model(tiny_model_dir), _model(tiny_model_dir)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    target, horizon, beta, gamma, eps = 0.01, 40, 0.2, 0.9, 1e-5
    cfg = algorithm_config(**ON_POLICY, adv=dict(estimator="reinforce_baseline", discount=gamma), kl=dict(coef=beta, in_reward=True, estimator=estimator, target=target, horizon=horizon), norm=dict(eps=eps))
    actor = PPOActor(RefEngine(model, lr=0.0), cfg, ref=RefEngine(ref_model),
                     tracker=StatsTracker())
    for step in range(3):
        batch = _batch(model, seed=step)
        prepared = actor.compute_advantages(batch)
        r, g = batch["rewards"].tolist(), batch["group_id"].tolist()
        rets, seq_kls = {}, []
        for i in range(8):
            kls = _kl_ref(model, ref_model, batch, i, estimator)
            seq_kls.append(_mean([k for _, k in kls]))
            mu = _mean([r[j] for j in range(8) if g[j] == g[i]])
            ret = 0.0
            for idx in reversed(range(len(kls))):
                t, k = kls[idx]
                rt = -beta * k + ((r[i] - mu) if idx == len(kls) - 1 else 0.0)
                ret = rt + gamma * ret
                rets[(i, t)] = ret
        mu = _mean(list(rets.values()))
        sd = _std(list(rets.values()), unbiased=False)
        for (i, t), ret in rets.items():
            want = (ret - mu) / (sd + eps)
            assert float(prepared["advantages"][i, t - 1]) == pytest.approx(want, abs=2e-5)
        actor.update(prepared)
        kl = _mean(seq_kls)
        err = max(-0.2, min(0.2, kl / target - 1.0))
        beta = beta * (1.0 + err * 8 / horizon)
        assert actor.kl_controller.value == pytest.approx(beta, rel=1e-6)
    assert actor.kl_controller.value != 0.2
    # checkpointed state resumes the coefficient
    other = PPOActor(RefEngine(model), cfg, ref=RefEngine(ref_model), tracker=StatsTracker())
    other.load_state_dict(actor.state_dict())
    assert other.kl_controller.value == actor.kl_controller.value


def test_kl_as_loss_uses_the_controllers_coefficient(tiny_model_dir):
    """kl_in_reward=False: the loss adds beta * KL_t with the controller's current beta, so
    the loss difference of two coefficients is (b1 - b2) * token-mean KL."""
    model, ref_model = _model(tiny_model_dir), _model(tiny_model_dir)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.mul_(0.9)
    batch = _batch(model)
    cfg = algorithm_config(**ON_POLICY, adv=dict(estimator="grpo"), kl=dict(coef=0.1, estimator="k3", target=0.5), loss=dict(agg_mode="token-mean"))
    losses = []
    for coef in (0.1, 0.4):
        actor = PPOActor(RefEngine(model, lr=0.0), cfg, ref=RefEngine(ref_model),
                         tracker=StatsTracker())
        actor.kl_controller.value = coef
        losses.append(actor.update(batch)["loss"])
    kls = [k for i in range(8) for _, k in _kl_ref(model, ref_model, batch, i, "k3")]
    assert losses[1] - losses[0] == pytest.approx(0.3 * _mean(kls), abs=2e-5)
