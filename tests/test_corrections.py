"""Train/inference corrections (TIS, MIS per token and per sequence, IcePop) and the gap
metrics, against float64 references written here from the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.algorithms.actors.loss_fns import make_policy_loss_fn
from areal_like.algorithms.corrections import corrected_weights
from areal_like.algorithms.mismatch import record_gap
from areal_like.api.algorithm_config import CORRECTION_BOUNDS, OffPolicyConfig
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.utils.stats_tracker import StatsTracker

# three sequences, next-token aligned (a sequence's last position trains nothing): 5 tokens,
# an empty response (2 untrained tokens), 6 tokens
MASK = [True, True, False, True, False, False, False, True, True, True, False, True, False]
CU = [0, 5, 7, 13]
POISONS = [float("nan"), float("inf"), -float("inf")]


def _logps(seed: int) -> tuple[list[float], list[float]]:
    """(prox, behav): behav = prox + noise, some tokens far apart (weights 0.2 ... 8)."""
    g = torch.Generator().manual_seed(seed)
    prox = (-torch.rand(len(MASK), generator=g, dtype=torch.float64) * 3).tolist()
    noise = (torch.randn(len(MASK), generator=g, dtype=torch.float64) * 0.8).tolist()
    return prox, [p - n for p, n in zip(prox, noise, strict=True)]


def _reference(prox: list[float], behav: list[float], name: str, low, high, cap=None):
    """(weight, kept) per token, in float64 Python: w = pi_prox / pi_behav."""
    w = [math.exp(p - b) if m else 0.0 for p, b, m in zip(prox, behav, MASK, strict=True)]
    kept = [m and (cap is None or wt <= cap) for m, wt in zip(MASK, w, strict=True)]
    if name == "tis":
        w = [min(wt, high) for wt in w]
    elif name in ("mis_token", "icepop"):
        kept = [k and low <= wt <= high for k, wt in zip(kept, w, strict=True)]
    elif name == "mis_seq":
        for start, end in zip(CU[:-1], CU[1:], strict=True):
            logs = [prox[t] - behav[t] for t in range(start, end) if MASK[t]]
            geo = math.exp(sum(logs) / len(logs)) if logs else 1.0
            for t in range(start, end):
                kept[t] = kept[t] and low <= geo <= high
    return [wt if k else 0.0 for wt, k in zip(w, kept, strict=True)], kept


@pytest.mark.parametrize("poison", [None, *POISONS], ids=["clean", "nan", "inf", "-inf"])
@pytest.mark.parametrize("name", sorted(CORRECTION_BOUNDS))
def test_corrected_weights_match_the_formulas(name, poison):
    prox, behav = _logps(seed=3)
    low, high = CORRECTION_BOUNDS[name]
    want_w, want_kept = _reference(prox, behav, name, low, high, cap=6.0)
    mask = torch.tensor(MASK)
    p, b = torch.tensor(prox, dtype=torch.float64), torch.tensor(behav, dtype=torch.float64)
    if poison is not None:  # masked positions may hold anything
        p = torch.where(mask, p, torch.full_like(p, poison))
        b = torch.where(mask, b, torch.full_like(b, -poison))
    config = OffPolicyConfig(correction=name, behav_imp_weight_cap=6.0)
    w, kept = corrected_weights(p, b, mask, torch.tensor(CU), config)
    assert kept.tolist() == want_kept
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12,
                               atol=0)
    assert not kept[5] and not kept[6]  # the empty response keeps nothing
    capped_only = _reference(prox, behav, "none", None, None, cap=6.0)[1]
    if name == "tis":  # the data exercise each correction
        assert max(want_w) == high
    elif name != "none":
        assert sum(want_kept) < sum(capped_only)


def test_configured_bounds_replace_the_defaults():
    prox, behav = _logps(seed=3)
    want_w, want_kept = _reference(prox, behav, "mis_token", 0.8, 1.25)
    config = OffPolicyConfig(correction="mis_token", correction_low=0.8, correction_high=1.25)
    w, kept = corrected_weights(torch.tensor(prox, dtype=torch.float64),
                                torch.tensor(behav, dtype=torch.float64), torch.tensor(MASK),
                                torch.tensor(CU), config)
    assert kept.tolist() == want_kept and sum(want_kept) < sum(MASK)
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["tis", "mis_token", "mis_seq", "icepop"])
def test_the_decoupled_loss_uses_the_corrected_weight(name):
    """Token-mean PPO loss of one micro-batch = the float64 reference with the corrected
    weight, and NaN/inf at masked positions change neither loss nor gradient."""
    prox, behav = _logps(seed=5)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(len(MASK), 7, generator=g, dtype=torch.float32)
    ids = torch.randint(0, 7, (len(MASK),), generator=g)
    adv = torch.randn(len(MASK), generator=g).tolist()
    config = algorithm_config(loss={"policy": "ppo", "eps_clip": 0.2},
                              off_policy={"correction": name})
    low, high = CORRECTION_BOUNDS[name]
    weight, _ = _reference(prox, behav, name, low, high)
    # the closure's log-prob of token t+1 at position t
    logp = torch.log_softmax(logits.double(), -1)
    next_ids = torch.cat([ids[1:], ids[:1]])
    lp = logp.gather(1, next_ids[:, None])[:, 0].tolist()
    terms = []
    for t, m in enumerate(MASK):
        if m:
            r = math.exp(lp[t] - prox[t])
            terms.append(max(-adv[t] * r, -adv[t] * min(max(r, 0.8), 1.2)) * weight[t])
    want = sum(terms) / len(terms)
    losses = []
    for poison in (None, float("nan")):
        p = torch.tensor(prox)
        b = torch.tensor(behav)
        if poison is not None:
            p = torch.where(torch.tensor(MASK), p, torch.full_like(p, poison))
            b = torch.where(torch.tensor(MASK), b, torch.full_like(b, poison))
        mb = TensorDict({"input_ids": ids, "loss_mask": torch.tensor(MASK),
                         "cu_seqlens": torch.tensor(CU), "advantages": torch.tensor(adv),
                         "old_logp": p, "prox_logp": p, "logprobs": b}, batch_size=[])
        leaf = logits.clone().requires_grad_(True)
        loss = make_policy_loss_fn(config, StatsTracker())(leaf, mb)
        loss.backward()
        losses.append((float(loss.detach()), leaf.grad))
    assert losses[0][0] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert losses[1][0] == losses[0][0] and torch.equal(losses[1][1], losses[0][1])


def test_corrections_refuse_what_they_cannot_combine_with():
    with pytest.raises(ValueError, match=r"off_policy.decoupled=False is invalid: expected "
                                         r"True with correction='tis'"):
        OffPolicyConfig(correction="tis", decoupled=False, recompute_logprob=False)
    with pytest.raises(ValueError, match="truncates from above only"):
        OffPolicyConfig(correction="tis", correction_low=0.5)
    with pytest.raises(ValueError, match=r"correction_high=0.5 is invalid: with "
                                         r"correction='mis_token' the bounds would be "
                                         r"low=0.8 >= high=0.5 \(the other is set\)"):
        OffPolicyConfig(correction="mis_token", correction_low=0.8, correction_high=0.5)
    with pytest.raises(ValueError, match="one of"):
        OffPolicyConfig(correction="mis")
    # GSPO has one ratio per sequence: only the sequence-level correction fits it
    for name in ("tis", "mis_token", "icepop"):
        with pytest.raises(ValueError, match=f"correction='{name}' weights tokens one by one"):
            PPOActor(None, algorithm_config(loss={"policy": "gspo"},
                                            off_policy={"correction": name}))
    PPOActor(None, algorithm_config(loss={"policy": "gspo"},
                                    off_policy={"correction": "mis_seq"}))


def test_gap_metrics_match_a_float64_reference():
    """Padded rows as sequences; lags 0, 1 and 3 (pooled as 3+)."""
    prox, behav = _logps(seed=8)
    rows = [(0, 5), (5, 7), (7, 13)]
    width = 6
    pad = torch.zeros(3, width, dtype=torch.float64)
    p, b, m = pad.clone(), pad.clone(), torch.zeros(3, width, dtype=torch.bool)
    lag = torch.zeros(3, width, dtype=torch.long)
    for i, (start, end) in enumerate(rows):
        n = end - start
        p[i, :n] = torch.tensor(prox[start:end], dtype=torch.float64)
        b[i, :n] = torch.tensor(behav[start:end], dtype=torch.float64)
        m[i, :n] = torch.tensor(MASK[start:end])
        lag[i, :n] = [0, 1, 3][i]
    tracker = StatsTracker()
    with tracker.scope("actor"):
        record_gap(tracker, b.float(), p.float(), m, lag, OffPolicyConfig())
    out = tracker.export()
    d = [prox[t] - behav[t] for t in range(len(MASK)) if MASK[t]]
    w = [math.exp(x) for x in d]
    k3 = [x - 1 - math.log(x) for x in w]
    assert out["actor/gap/abs_log_diff/avg"] == pytest.approx(
        sum(abs(x) for x in d) / len(d), rel=1e-5)
    assert out["actor/gap/abs_log_diff/max"] == pytest.approx(max(abs(x) for x in d), rel=1e-5)
    assert out["actor/gap/k3/avg"] == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    assert out["actor/gap/imp_weight/max"] == pytest.approx(max(w), rel=1e-5)
    icepop = sum(1 for x in w if not 0.5 <= x <= 5.0) / len(w)
    assert out["actor/gap/icepop_masked/avg"] == pytest.approx(icepop)
    assert out["actor/gap/tis_truncated/avg"] == pytest.approx(
        sum(1 for x in w if x > 2.0) / len(w))
    # two sequences with tokens (the empty response is not a sequence of the statistic)
    geo = [math.exp(sum(prox[t] - behav[t] for t in range(s, e) if MASK[t])
                    / sum(MASK[s:e])) for s, e in (rows[0], rows[2])]
    assert out["actor/gap/gap_seqs"] == 2
    assert out["actor/gap/seq_imp_weight/avg"] == pytest.approx(sum(geo) / 2, rel=1e-5)
    lag0 = [abs(prox[t] - behav[t]) for t in range(0, 5) if MASK[t]]
    assert out["actor/gap/lag0/abs_log_diff/avg"] == pytest.approx(sum(lag0) / len(lag0),
                                                                   rel=1e-5)
    assert "actor/gap/lag1/abs_log_diff/avg" not in out  # lag 1 is the empty response
    lag3 = [abs(prox[t] - behav[t]) for t in range(7, 13) if MASK[t]]
    assert out["actor/gap/lag3+/abs_log_diff/avg"] == pytest.approx(sum(lag3) / len(lag3),
                                                                    rel=1e-5)


def test_gap_k3_keeps_its_precision_where_the_gap_is_tiny():
    """|d| ~ 1e-5: w - 1 - log w in float32 cancels to noise (or below zero); the metric
    equals the series d^2/2 + d^3/6 + d^4/24 of the exact float32 differences."""
    behav = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    gaps = [2.0**-17, -(2.0**-16), 2.0**-20, 3 * 2.0**-18]  # exact in float32 at these values
    prox = behav + torch.tensor([gaps])
    mask = torch.ones_like(behav, dtype=torch.bool)
    tracker = StatsTracker()
    with tracker.scope("actor"):
        record_gap(tracker, behav, prox, mask, None, OffPolicyConfig())
    out = tracker.export()
    d = [float(p) - float(b) for p, b in zip(prox[0].tolist(), behav[0].tolist(), strict=True)]
    assert d == gaps  # the float32 differences are the intended gaps
    k3 = [x * x / 2 + x**3 / 6 + x**4 / 24 for x in d]
    assert out["actor/gap/k3/avg"] == pytest.approx(sum(k3) / len(k3), rel=1e-5)
    assert out["actor/gap/k3/min"] == pytest.approx(min(k3), rel=1e-5) and min(k3) > 0
