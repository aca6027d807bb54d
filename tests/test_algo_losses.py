"""Policy and value losses against per-token float64 loop references, with gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from areal_like.algorithms import PolicyLossInputs, get_policy_loss
from areal_like.algorithms.losses import (
    behaviour_importance_weights,
    cispo_loss,
    cpgd_loss,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_loss,
    reinforce_loss,
    value_loss,
)
from areal_like.api.algorithm_presets import algorithm_config

TOL = dict(rtol=1e-12, atol=1e-12)


def _data(seed, n=40):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    return lp, old, adv, mask


def _ref_ppo_token(lp, old, a, eps_l, eps_h, c):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - eps_l), 1 + eps_h))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


@pytest.mark.parametrize("eps_h,c_clip", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_loss_matches_reference(eps_h, c_clip):
    lp, old, adv, mask = _data(0)
    lp[:4] = old[:4] + torch.tensor([2.0, 2.0, -2.0, -2.0], dtype=torch.float64)  # far off 1
    adv[:4] = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask[:4] = True
    loss, stats = ppo_loss(lp, old, adv, mask, 0.2, eps_h, c_clip)
    high = 0.2 if eps_h is None else eps_h
    want = [(_ref_ppo_token(float(a), float(b), float(c), 0.2, high, c_clip) if m else 0.0)
            for a, b, c, m in zip(lp, old, adv, mask, strict=True)]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **TOL)
    clipped = [bool(m) and (-float(c) * min(max(math.exp(a - b), 0.8), 1 + high)
                            > -float(c) * math.exp(a - b))
               for a, b, c, m in zip(lp, old, adv, mask, strict=True)]
    assert stats["clip_mask"].tolist() == clipped
    if c_clip is not None:
        assert stats["dual_clip_mask"][1]  # ratio e^2 with A < 0: the dual clip binds
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: ppo_loss(v, old, adv, mask, 0.2, eps_h, c_clip)[0], (x,))


def test_ppo_extreme_ratios_and_empty_mask_stay_finite():
    lp = torch.tensor([0.0, -1e4, 0.0, -50.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-200.0, 0.0, -1e9, 0.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, 1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True])
    loss, _ = ppo_loss(lp, old, adv, mask)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert loss[2] == 0 and lp.grad[2] == 0
    empty = torch.zeros(4, dtype=torch.bool)
    lp.grad = None
    loss, _ = ppo_loss(lp, old, adv, empty)
    loss.sum().backward()
    assert (loss == 0).all() and (lp.grad == 0).all()


def test_decoupled_equals_ppo_when_proximal_is_behaviour():
    lp, old, adv, mask = _data(1)
    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    std, _ = ppo_loss(x1, old, adv, mask, 0.2, 0.28, 3.0)
    dec, st = decoupled_ppo_loss(x2, old, old, adv, mask, 0.2, 0.28, 3.0, behav_imp_weight_cap=5.)
    torch.testing.assert_close(dec, std, **TOL)
    std.sum().backward()
    dec.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, **TOL)
    assert st["behav_kept_mask"].tolist() == mask.tolist()


def test_decoupled_weights_and_cap():
    lp, prox, adv, mask = _data(2)
    behav = prox - torch.linspace(-2, 2, prox.shape[0], dtype=torch.float64)  # w = e^{-2..2}
    w, kept = behaviour_importance_weights(prox, behav, mask, cap=3.0)
    want_w = [(math.exp(float(p - b)) if m and math.exp(float(p - b)) <= 3.0 else 0.0)
              for p, b, m in zip(prox, behav, mask, strict=True)]
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float64), **TOL)
    assert kept.tolist() == [bool(m) and math.exp(float(p - b)) <= 3.0
                             for p, b, m in zip(prox, behav, mask, strict=True)]
    assert (mask & ~kept).sum() > 0  # some tokens were capped
    loss, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_imp_weight_cap=3.0)
    base, _ = ppo_loss(lp, prox, adv, mask)
    torch.testing.assert_close(loss, base * w, **TOL)
    assert (loss[mask & ~kept] == 0).all()


def test_gspo_uses_the_sequence_ratio():
    lp, old, adv, mask = _data(3, n=12)
    cu = torch.tensor([0, 3, 7, 7, 12])  # includes an empty sequence
    adv = torch.tensor([0.5] * 3 + [-1.0] * 4 + [2.0] * 5, dtype=torch.float64)
    loss, stats = gspo_loss(lp, old, adv, mask, cu, 0.01, 0.02)
    want = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        idx = [t for t in range(a, b) if mask[t]]
        s = math.exp(sum(float(lp[t] - old[t]) for t in idx) / len(idx)) if idx else 1.0
        for t in range(a, b):
            want.append(_ref_ppo_token(math.log(s), 0.0, float(adv[t]), 0.01, 0.02, None)
                        if mask[t] else 0.0)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **TOL)
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: gspo_loss(v, old, adv, mask, cu, 0.5, 0.5)[0], (x,))


def test_cispo_reinforce_cpgd_match_reference():
    lp, old, adv, mask = _data(4)
    x = lp.clone().requires_grad_(True)
    loss, _ = cispo_loss(x, old, adv, mask, 0.2, 0.28)
    w = [min(max(math.exp(float(a - b)), 0.8), 1.28) for a, b in zip(lp, old, strict=True)]
    want = [(-wi * float(c) * float(a) if m else 0.0)
            for wi, a, c, m in zip(w, lp, adv, mask, strict=True)]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **TOL)
    loss.sum().backward()  # the clipped weight is a constant: d/dlp = -w * A
    want_grad = [(-wi * float(c) if m else 0.0) for wi, c, m in zip(w, adv, mask, strict=True)]
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=torch.float64), **TOL)

    loss, _ = reinforce_loss(lp, adv, mask)
    torch.testing.assert_close(loss, torch.where(mask, -adv * lp, 0.0), **TOL)

    loss, _ = cpgd_loss(lp, old, adv, mask, 0.2, 0.28, drift_coef=0.1)
    want = []
    for a, b, c, m in zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), strict=True):
        lr = a - b
        pg = max(-c * lr, -c * min(max(lr, math.log(0.8)), math.log(1.28)))
        want.append(pg + 0.1 * (math.exp(lr) - 1 - lr) if m else 0.0)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **TOL)
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: cpgd_loss(v, old, adv, mask, 0.2, 0.28, 0.1)[0],
                                    (x,))


def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(5)
    v = torch.randn(30, generator=g, dtype=torch.float64)
    old = v + torch.randn(30, generator=g, dtype=torch.float64) * 0.5
    ret = torch.randn(30, generator=g, dtype=torch.float64)
    mask = torch.rand(30, generator=g) > 0.2
    loss, st = value_loss(v, old, ret, mask, 0.2)
    want = []
    for a, o, r, m in zip(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), strict=True):
        vc = o + min(max(a - o, -0.2), 0.2)
        want.append(0.5 * max((a - r) ** 2, (vc - r) ** 2) if m else 0.0)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), **TOL)
    assert st["value_clip_mask"].any()
    x = v.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y: value_loss(y, old, ret, mask, 0.2)[0], (x,))
    plain, _ = value_loss(v, old, ret, mask, None)
    torch.testing.assert_close(plain, torch.where(mask, 0.5 * (v - ret) ** 2, 0.0), **TOL)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "reinforce", "cpgd"])
def test_registered_losses_are_zero_off_mask_and_read_eps_from_config(name):
    lp, old, adv, mask = _data(6, n=10)
    cu = torch.tensor([0, 4, 10])
    cfg = algorithm_config(loss=dict(eps_clip=0.1, eps_clip_high=0.3, cpgd_drift_coef=0.05))
    loss, _ = get_policy_loss(name)(PolicyLossInputs(lp, old, adv, mask, cu), cfg)
    assert loss.shape == lp.shape and (loss[~mask] == 0).all() and torch.isfinite(loss).all()
    if name == "ppo":
        torch.testing.assert_close(loss, ppo_loss(lp, old, adv, mask, 0.1, 0.3)[0], **TOL)
    with pytest.raises(KeyError, match="ppo"):
        get_policy_loss("no_such_loss")
