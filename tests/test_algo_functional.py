"""Functional pieces of the algorithms against independent float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from areal_like.algorithms.aggregation import aggregate_loss, loss_weight
from areal_like.algorithms.filters import drop_zero_variance_groups, filter_zero_variance_groups
from areal_like.algorithms.functional import (
    group_index_from_ids,
    masked_mean,
    segment_ids,
    segment_sum,
    shift_to_next_token,
    top_fraction_mask,
)
from areal_like.algorithms.kl import kl_estimate, kl_full
from areal_like.algorithms.normalize import RunningMoments, clip_filter_weights, normalize
from areal_like.algorithms.rewards import overlong_penalty, shape_rewards

TOL = dict(rtol=1e-12, atol=1e-12)


# ---- KL ----------------------------------------------------------------------------------

def test_kl_estimators_match_formulas_and_are_differentiable():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(50, generator=g, dtype=torch.float64) - 2
    ref = torch.randn(50, generator=g, dtype=torch.float64) - 2
    ref_formulas = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(b - a) - 1 - (b - a),
    }
    for name, f in ref_formulas.items():
        got = kl_estimate(lp, ref, name)
        want = torch.tensor([f(float(a), float(b)) for a, b in zip(lp, ref, strict=True)],
                            dtype=torch.float64)
        torch.testing.assert_close(got, want, **TOL)
        x = lp.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda v, n=name: kl_estimate(v, ref, n), (x,))
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def _full_kl_reference(logits: list[float], top: dict[int, float]) -> float:
    """KL(pi || pi_ref) in float64 Python: pi = softmax(logits); pi_ref = exp(top[v]) on its
    top tokens, the remaining mass split evenly over the others."""
    z = math.log(sum(math.exp(x) for x in logits))
    rest = (1 - sum(math.exp(v) for v in top.values())) / max(len(logits) - len(top), 1)
    total = 0.0
    for v, x in enumerate(logits):
        lp = x - z
        ref = top[v] if v in top else math.log(rest)
        total += math.exp(lp) * (lp - ref)
    return total


@pytest.mark.parametrize("k", [3, 7])  # part of the vocabulary (the rest spread), all of it
def test_full_kl_matches_the_sum_over_the_vocabulary(k):
    g = torch.Generator().manual_seed(k)
    n_pos, n_vocab = 5, 7
    logits = torch.randn(n_pos, n_vocab, generator=g, dtype=torch.float64) * 2
    ref_logits = torch.randn(n_pos, n_vocab, generator=g, dtype=torch.float64) * 2
    ref_logp = torch.log_softmax(ref_logits, -1)
    top_lp, top_ids = ref_logp.topk(k, dim=-1)
    got = kl_full(torch.log_softmax(logits, -1), top_ids, top_lp)
    want = [_full_kl_reference(logits[t].tolist(),
                               dict(zip(top_ids[t].tolist(), top_lp[t].tolist(), strict=True)))
            for t in range(n_pos)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), **TOL)
    if k == n_vocab:  # the exact KL: non-negative, 0 against itself
        assert (got >= -1e-12).all()
        same = kl_full(ref_logp, *reversed(ref_logp.topk(k, dim=-1)))
        torch.testing.assert_close(same, torch.zeros(n_pos, dtype=torch.float64), **TOL)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: kl_full(torch.log_softmax(v, -1), top_ids, top_lp), (x,))
    with pytest.raises(ValueError, match="outside the policy's vocabulary"):
        kl_full(torch.log_softmax(logits, -1), top_ids + n_vocab, top_lp)


# ---- alignment and segments ---------------------------------------------------------------

def test_shift_to_next_token_zero_fills_without_wrapping():
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert shift_to_next_token(x).tolist() == [[2, 3, 0], [5, 6, 0]]


def test_segment_helpers_handle_trailing_padding():
    cu = torch.tensor([0, 2, 5])
    ids = segment_ids(cu, 7)  # two padding tokens past cu[-1]
    assert ids.tolist() == [0, 0, 1, 1, 1, 2, 2]
    x = torch.arange(7, dtype=torch.float64)
    assert segment_sum(x, cu).tolist() == [1.0, 9.0]
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_ids(torch.tensor([0, 9]), 7)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(torch.tensor([float("nan"), 1.0]), torch.tensor([False, False])) == 0.0


def test_top_fraction_mask_keeps_highest_scores_among_masked():
    scores = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3, 5.0])
    mask = torch.tensor([True, True, True, True, True, False])
    assert top_fraction_mask(scores, mask, 0.4).tolist() == [True, False, False, True, False,
                                                             False]
    assert top_fraction_mask(scores, mask, 1.0).tolist() == mask.tolist()
    assert not top_fraction_mask(scores, torch.zeros(6, dtype=torch.bool), 0.5).any()


def test_group_index_from_ids_and_group_size():
    assert group_index_from_ids(torch.tensor([7, 3, 7, 3]), 4, 1).tolist() == [1, 0, 1, 0]
    assert group_index_from_ids(None, 6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="group_size=4"):
        group_index_from_ids(None, 6, 4)
    with pytest.raises(ValueError, match="group_id"):
        group_index_from_ids(torch.tensor([0.5, 1.0]), 2, 1)


# ---- rewards --------------------------------------------------------------------------------

def test_overlong_penalty_piecewise():
    lengths = torch.tensor([4, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_response_tokens=10, overlong_tokens=4, penalty_factor=2.0)
    # expected length 6: penalty (6 - n) / 4 * 2 in (6, 10], -2 beyond 10
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0, -2.0, -2.0]


def test_shape_rewards_scalar_and_dense():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]).bool()
    r = torch.tensor([1.0, 2.0, 30.0])
    tokens, seq = shape_rewards(r, mask, scale=2.0, bias=-0.5, clip=10.0,
                                overlong=torch.tensor([0.0, 0.0, -1.0]))
    want_seq = [min(max((1.0 - 0.5) * 2, -10), 10), (2.0 - 0.5) * 2, 10.0]
    assert seq.tolist() == want_seq
    assert tokens.tolist() == [[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 0, 0, 10.0]]

    dense = torch.tensor([[0, 0.5, 2.0, 0], [0, 0, 0, 0], [1.0, 0, -9.0, 0]])
    tokens, seq = shape_rewards(dense, mask, scale=2.0, bias=1.0, clip=10.0)
    # bias goes once to the last trained token; scale and clip act on every event
    assert tokens.tolist() == [[0, 1.0, 6.0, 0], [0, 0, 0, 0], [2.0, 0, -10.0, 2.0]]
    assert seq.tolist() == [7.0, 0.0, -6.0]
    with pytest.raises(ValueError, match=r"'rewards'\[0, 3\]"):
        shape_rewards(torch.tensor([[0, 0, 0, 1.0], [0] * 4, [0] * 4]), mask)
    with pytest.raises(ValueError, match="rewards"):
        shape_rewards(torch.zeros(2), mask)


# ---- normalisation --------------------------------------------------------------------------

def _ref_normalize(x, mask, groups, mean, std, loo, eps):
    """Loop reference over python floats (see normalize.py's formulas)."""
    b, n = len(x), len(x[0])
    out = [[0.0] * n for _ in range(b)]
    for g in set(groups):
        rows = [i for i in range(b) if groups[i] == g]
        vals = [x[i][t] for i in rows for t in range(n) if mask[i][t]]
        if not vals:
            continue
        mu = sum(vals) / len(vals)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
        flat = max(vals) == min(vals)
        for i in rows:
            others = [x[j][t] for j in rows if j != i for t in range(n) if mask[j][t]]
            base = sum(others) / len(others) if (loo and others) else mu
            for t in range(n):
                if not mask[i][t]:
                    continue
                v = x[i][t] - base if mean else x[i][t]
                if std and not flat:
                    v = v / (sigma + eps)
                if mean and flat:
                    v = 0.0
                out[i][t] = v
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mean,std,loo", [(True, True, False), (True, False, False),
                                          (False, True, False), (True, False, True),
                                          (True, True, True)])
def test_normalize_matches_loop_reference(mean, std, loo):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 5, generator=g, dtype=torch.float64)
    x[6:8] = 0.25  # a group (rows 6, 7) whose values are all equal
    mask = torch.rand(9, 5, generator=g) > 0.3
    mask[6:8] = True
    mask[2] = False  # an empty row
    groups = [0, 0, 0, 1, 1, 2, 3, 3, 4]  # group 2 and 4: single sequence
    got = normalize(x, mask, torch.tensor(groups), mean=mean, std=std, leave_one_out=loo,
                    eps=1e-5)
    want = _ref_normalize(x.tolist(), mask.tolist(), groups, mean, std, loo, 1e-5)
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.isnan(got).any()
    if mean:
        assert (got[6:8] == 0).all()  # a flat group gives exactly zero
    batch = normalize(x, mask, None, mean=mean, std=std, leave_one_out=loo, eps=1e-5)
    torch.testing.assert_close(
        batch, _ref_normalize(x.tolist(), mask.tolist(), [0] * 9, mean, std, loo, 1e-5), **TOL)


def test_normalize_sequence_scores_of_equal_rewards_is_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.3], dtype=torch.float64)
    got = normalize(r, None, torch.tensor([0, 0, 0, 1, 1, 1]), eps=1e-8)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("decay", [1.0, 0.5, 0.0])
def test_running_moments_match_weighted_reference(decay):
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * (i + 1) + i
               for i, n in enumerate([5, 8, 3])]
    rm = RunningMoments(decay)
    for b in batches:
        rm.update(b)
    k = len(batches)
    weights = [decay ** (k - 1 - i) for i in range(k)]
    pairs = [(w, float(v)) for w, b in zip(weights, batches, strict=True) for v in b]
    total = sum(w for w, _ in pairs)
    mu = sum(w * v for w, v in pairs) / total
    var = sum(w * (v - mu) ** 2 for w, v in pairs) / total
    assert rm.mean == pytest.approx(mu, rel=1e-12)
    assert rm.var == pytest.approx(var, rel=1e-10)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(rm.normalize(x, eps=0.0), (x - mu) / math.sqrt(var), **TOL)


def test_running_moments_flat_history_gives_zero():
    rm = RunningMoments()
    rm.update(torch.full((4,), 3.0))
    assert rm.normalize(torch.full((2,), 3.0)).tolist() == [0.0, 0.0]


def _seed_clip_filter(rewards, max_weight=3.0, lam=1.0):
    """LightRFT's clip_filter_like_weight_func on a [n_prompts][n_samples] list, float64."""
    flat = [max(g) == min(g) for g in rewards]
    if all(flat):
        return [[1.0] * len(g) for g in rewards]
    w = min(len(rewards) / (len(rewards) - sum(flat)), max_weight)
    return [[lam if f else w] * len(g) for g, f in zip(rewards, flat, strict=True)]


@pytest.mark.parametrize("rewards,lam", [
    ([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], 1.0),  # 4 / 1 = 4, capped at 3
    ([[1.0, 0.0], [1.0, 1.0]], 1.0),
    ([[1.0, 0.0], [1.0, 1.0]], 0.25),
    ([[0.5, 0.5, 0.5], [0.2, 0.1, 0.2], [0.3, 0.3, 0.3]], 1.0),
    ([[1.0, 1.0], [0.0, 0.0]], 1.0),  # all flat: all ones
])
def test_clip_filter_weights_follow_the_seed(rewards, lam):
    n = len(rewards[0])
    scores = torch.tensor([x for g in rewards for x in g], dtype=torch.float64)
    groups = torch.arange(len(rewards)).repeat_interleave(n)
    got = clip_filter_weights(scores, groups, max_weight=3.0, flat_weight=lam)
    want = torch.tensor([x for g in _seed_clip_filter(rewards, 3.0, lam) for x in g],
                        dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ---- aggregation ------------------------------------------------------------------------------

def _ref_aggregate(seqs, mode, constant):
    """seqs: list of (losses, mask) per sequence, python floats / bools."""
    trained = [[v for v, m in zip(ls, ms, strict=True) if m] for ls, ms in seqs]
    nonempty = [t for t in trained if t]
    if mode == "token-mean":
        n = sum(len(t) for t in trained)
        return sum(sum(t) for t in trained) / max(n, 1)
    n = max(len(nonempty), 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(t) for t in nonempty) / n
    if mode == "seq-mean-token-mean":
        return sum(sum(t) / len(t) for t in nonempty) / n
    return sum(sum(t) for t in nonempty) / (n * constant)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "constant"])
def test_aggregation_matches_reference_and_combines_across_micro_batches(mode):
    g = torch.Generator().manual_seed(3)
    lengths = [3, 1, 6, 4, 2]
    loss = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    mask = torch.rand(sum(lengths), generator=g) > 0.3
    mask[3] = False  # the 1-token sequence has no trained token
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    seqs = [(loss[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:],
                                                                      strict=True)]
    got = aggregate_loss(loss, mask, cu, mode, constant=7.0)
    assert float(got) == pytest.approx(_ref_aggregate(seqs, mode, 7.0), rel=1e-12)
    # the engine's weighted mean over two micro-batches equals the whole-batch formula
    parts = []
    for rows in ([0, 1, 2], [3, 4]):
        a, b = int(cu[rows[0]]), int(cu[rows[-1] + 1])
        sub_cu = cu[rows[0]:rows[-1] + 2] - a
        mb = {"loss_mask": mask[a:b], "cu_seqlens": sub_cu}
        parts.append((aggregate_loss(loss[a:b], mask[a:b], sub_cu, mode, 7.0),
                      loss_weight(mb, mode)))
    combined = sum(v * w for v, w in parts) / sum(w for _, w in parts)
    assert float(combined) == pytest.approx(float(got), rel=1e-12)


def test_aggregation_modes_differ_as_their_formulas_say():
    # sequence A: 1 token with loss 4; sequence B: 3 tokens with loss 1 each
    loss = torch.tensor([4.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 1, 4])
    agg = {m: float(aggregate_loss(loss, mask, cu, m, constant=5.0))
           for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant")}
    assert agg == {"token-mean": 7 / 4, "seq-mean-token-sum": 7 / 2,
                   "seq-mean-token-mean": (4 + 1) / 2, "constant": 7 / (2 * 5)}
    padded = {"loss_mask": torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])}
    assert int(loss_weight(padded, "token-mean")) == 4
    assert int(loss_weight(padded, "seq-mean-token-mean")) == 2


def test_aggregation_of_empty_mask_is_zero_and_unknown_mode_rejected():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "constant"):
        out = aggregate_loss(x, torch.zeros(2, dtype=torch.bool), torch.tensor([0, 2]), mode,
                             constant=8.0)
        assert float(out.detach()) == 0.0
    with pytest.raises(ValueError, match="loss.agg_constant"):  # Dr.GRPO without its budget
        aggregate_loss(x, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), "constant")
    with pytest.raises(ValueError, match="seq-sum"):
        aggregate_loss(x, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), "seq-sum")


# ---- dynamic sampling -------------------------------------------------------------------------

def test_dynamic_sampling_predicate_and_batch_filter():
    def traj(r):
        r = torch.tensor(r)
        return TensorDict({"rewards": r}, batch_size=[r.shape[0]])

    assert drop_zero_variance_groups(traj([1.0, 0.0, 1.0]))
    assert not drop_zero_variance_groups(traj([1.0, 1.0, 1.0]))
    assert not drop_zero_variance_groups(traj([0.5]))
    dense = TensorDict({"rewards": torch.tensor([[0, 1.0], [1.0, 0]])}, batch_size=[2])
    assert not drop_zero_variance_groups(dense)  # equal totals
    with pytest.raises(KeyError, match="rewards"):
        drop_zero_variance_groups(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))

    batch = TensorDict({"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
                        "row": torch.arange(6)}, batch_size=[6])
    kept, gi, counts = filter_zero_variance_groups(batch, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert kept["row"].tolist() == [0, 1, 4, 5]
    assert gi.tolist() == [0, 0, 1, 1]
    assert counts == {"n_groups_kept": 2, "n_groups_dropped": 1}
    flat = TensorDict({"rewards": torch.ones(4)}, batch_size=[4])
    kept, _, counts = filter_zero_variance_groups(flat, torch.tensor([0, 0, 1, 1]))
    assert kept.batch_size[0] == 4 and counts["n_groups_kept"] == 0


# ---- cross-rank statistics --------------------------------------------------------------------

_DIST_WORKER = """
import sys, torch, torch.distributed as dist
from areal_like.algorithms.normalize import RunningMoments, clip_filter_weights, normalize
rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
data = torch.load(out + "/data.pt")
rows = slice(0, 3) if rank == 0 else slice(3, 8)  # uneven shards
x, mask = data["x"][rows], data["mask"][rows]
whole_groups = slice(0, 4) if rank == 0 else slice(4, 8)  # a group lives on one rank
scores, groups = data["scores"][whole_groups], data["groups"][whole_groups]
rm = RunningMoments()
rm.update(x, mask, all_reduce=True)
torch.save({"adv": normalize(x, mask, None, leave_one_out=True, all_reduce=True),
            "moments": torch.tensor([rm.mean, rm.var], dtype=torch.float64),
            "weights": clip_filter_weights(scores, groups, 3.0, all_reduce=True)},
           f"{out}/rank{rank}.pt")
dist.destroy_process_group()
"""


def test_batch_statistics_pool_across_ranks(tmp_path):
    import os
    import subprocess
    import sys

    g = torch.Generator().manual_seed(9)
    data = {"x": torch.randn(8, 4, generator=g, dtype=torch.float64),
            "mask": torch.rand(8, 4, generator=g) > 0.3,
            "scores": torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5]),
            "groups": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])}
    torch.save(data, tmp_path / "data.pt")
    script = tmp_path / "worker.py"
    script.write_text(_DIST_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init"),
                               str(tmp_path)], env=env) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    full = normalize(data["x"], data["mask"], None, leave_one_out=True)
    torch.testing.assert_close(torch.cat([res[0]["adv"], res[1]["adv"]]), full, **TOL)
    sel = data["x"][data["mask"]]
    want = torch.tensor([float(sel.mean()), float(sel.var(unbiased=False))], dtype=torch.float64)
    for r in res:
        torch.testing.assert_close(r["moments"], want, rtol=1e-12, atol=1e-12)
    # groups 0 and 2 vary, 1 and 3 are flat (pooled: G = 4, G_flat = 2): 4 / 2 = 2, flat 1
    assert torch.cat([res[0]["weights"], res[1]["weights"]]).tolist() == [2.0, 2.0, 1.0, 1.0,
                                                                          2.0, 2.0, 1.0, 1.0]
