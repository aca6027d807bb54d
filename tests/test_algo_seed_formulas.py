"""The seeds' formulas, each against an independent float64 reference written here.

Dr.GRPO's constant, baselines shaped like the reward, KL-in-reward after normalisation,
clip-filter weights of flat groups, the batch-wide entropy filter across ranks, NaN/inf at
masked positions, and which algorithms need whole groups.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from config_helpers import rollout_config
from tensordict import TensorDict
from test_algo_actors import _grpo_ref
from test_algo_ref_engine import RefEngine, _batch, _model, _true_logprobs

from areal_like.algorithms import (
    AdvantageInputs,
    PPOActor,
    ReinforceActor,
    algorithm_preset,
    get_advantage_estimator,
    register_advantage_estimator,
    uses_group_statistics,
)
from areal_like.algorithms.actors.loss_fns import make_policy_loss_fn, make_value_loss_fn
from areal_like.algorithms.losses import (
    cispo_loss,
    cpgd_loss,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_loss,
    reinforce_loss,
    value_loss,
)
from areal_like.algorithms.registry import ADVANTAGE_ESTIMATORS
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.api.config import (
    AlgorithmConfig,
    GenerationHyperparameters,
    resolve_algorithm,
)
from areal_like.utils.stats_tracker import StatsTracker

ON_POLICY = dict(group_size=4, off_policy=dict(decoupled=False, recompute_logprob=False))


def _trained(batch, i):
    """Token positions t (token alignment) trained in row i, in order."""
    return [t for t in range(batch["input_ids"].shape[1]) if batch["loss_mask"][i, t]]


def _shape(x, cfg):
    return max(-cfg.shaping.clip, min(cfg.shaping.clip, (x + cfg.shaping.bias) * cfg.shaping.scaling))


# ---- Dr.GRPO: the constant is the generation budget ---------------------------------------

def test_dr_grpo_constant_is_the_generation_budget():
    algo = algorithm_preset("dr_grpo", group_size=4)
    assert algo.loss.agg_constant is None
    resolve_algorithm(algo, GenerationHyperparameters(n_samples=4, max_new_tokens=24),
                      rollout_config())
    assert algo.loss.agg_constant == 24.0 and algo.shaping.max_response_tokens == 24
    with pytest.raises(ValueError, match="algorithm.loss.agg_constant"):
        PPOActor(None, algorithm_preset("dr_grpo", group_size=4))
    with pytest.raises(ValueError, match="algorithm.shaping.max_response_tokens"):
        PPOActor(None, algorithm_preset("dapo", group_size=4, shaping=dict(overlong_tokens=2)))


def test_dr_grpo_loss_divides_the_token_sum_by_the_budget(tiny_model_dir):
    model = _model(tiny_model_dir)
    batch = _batch(model, noise=0.0)
    budget = 16.0
    cfg = algorithm_preset("dr_grpo", **ON_POLICY, loss=dict(agg_constant=budget))
    stats = PPOActor(RefEngine(model, lr=0.0, max_tokens_per_mb=24), cfg,
                     tracker=StatsTracker()).update(batch)
    # on-policy at ratio 1: l_t = -A_i; loss = sum_i sum_t -A_i / (N * budget)
    r, g = batch["rewards"].tolist(), batch["group_id"].tolist()
    adv = [r[i] - sum(r[j] for j in range(len(r)) if g[j] == g[i]) / g.count(g[i])
           for i in range(len(r))]
    n_tok = [len(_trained(batch, i)) for i in range(len(r))]
    want = sum(-adv[i] * n_tok[i] for i in range(len(r))) / (len(r) * budget)
    assert stats["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)


# ---- ReMax / REINFORCE: the baseline is shaped like the reward ---------------------------

SHAPING = dict(shaping=dict(scaling=2.0, bias=-0.25, clip=1.0))


def _baseline_batch(model):
    batch = _batch(model, noise=0.0)
    batch["rewards"] = torch.tensor([1.0, 0.2, 0.9, 0.0, 0.4, 0.75, 0.1, 0.6])
    batch["baseline_rewards"] = torch.tensor([0.5, 0.5, 0.0, 1.0, 0.3, 0.9, 0.2, 0.6])
    return batch


def test_remax_advantage_is_shaped_reward_minus_shaped_baseline(tiny_model_dir):
    model = _model(tiny_model_dir)
    batch = _baseline_batch(model)
    cfg = algorithm_preset("remax", group_size=4, **SHAPING)
    prepared = PPOActor(RefEngine(model), cfg, tracker=StatsTracker()).compute_advantages(batch)
    for i in range(8):
        want = (_shape(float(batch["rewards"][i]), cfg)
                - _shape(float(batch["baseline_rewards"][i]), cfg))
        for t in _trained(batch, i):
            assert float(prepared["advantages"][i, t - 1]) == pytest.approx(want, abs=1e-6)
    # ReinforceActor: the same shaping on both sides
    reinforce = ReinforceActor(RefEngine(model), cfg, tracker=StatsTracker())
    got = reinforce.compute_advantages(batch)
    for i in range(8):
        want = (_shape(float(batch["rewards"][i]), cfg)
                - _shape(float(batch["baseline_rewards"][i]), cfg))
        for t in _trained(batch, i):
            assert float(got["advantages"][i, t - 1]) == pytest.approx(want, abs=1e-6)


# ---- seed 002's group estimators with a discount: the shaped score's cumulative returns ----

def _seed002_returns(rewards, groups, mask_rows, name, gamma, eps):
    """Seed 002 in float64, by its formulas: the group-shaped score (group_norm: unbiased std
    + eps; rloo: leave-one-out mean) is the reward of the last action token, then
    get_cumulative_returns(reward, action_mask, gamma)."""
    shaped = []
    for i, r in enumerate(rewards):
        peers = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(peers)
        mean = sum(peers) / n
        if name == "group_norm":
            std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (n - 1))
            shaped.append((r - mean) / (std + eps))
        else:  # rloo
            shaped.append(r - (sum(peers) - r) / (n - 1))
    out = []
    for score, row in zip(shaped, mask_rows, strict=True):
        last = max(t for t, m in enumerate(row) if m)
        ret, cumulative = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            cumulative = (score if t == last else 0.0) * row[t] + gamma * cumulative
            ret[t] = cumulative if row[t] else 0.0
        out.append(ret)
    return out


@pytest.mark.parametrize("name", ["group_norm", "rloo"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_group_estimators_discount_the_score_as_seed_002(name, gamma):
    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, -1.0, 0.0, 1.5]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    lengths = [5, 3, 6, 1, 4, 6, 2, 5]
    mask = torch.tensor([[t < n for t in range(6)] for n in lengths])
    cfg = algorithm_config(adv=dict(estimator=name, discount=gamma, group_std="unbiased"),
                           norm=dict(eps=1e-8))  # seed 002's epsilon
    inputs = AdvantageInputs(token_rewards=torch.zeros(8, 6, dtype=torch.float64),
                             seq_rewards=torch.tensor(rewards, dtype=torch.float64),
                             loss_mask=mask, group_index=torch.tensor(groups))
    got = get_advantage_estimator(name)(inputs, cfg).advantages
    want = torch.tensor(_seed002_returns(rewards, groups, mask.tolist(), name, gamma, 1e-8),
                        dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if gamma < 1:  # the first token of a 6-token answer: gamma^5 of the last one's score
        assert float(got[2, 0]) == pytest.approx(float(got[2, 5]) * gamma ** 5, rel=1e-12)


def test_a_discount_an_estimator_cannot_honour_is_refused():
    with pytest.raises(ValueError, match=r"algorithm.adv.discount=0.9 means nothing to "
                                         r"algorithm.adv.estimator='action_norm'"):
        PPOActor(None, algorithm_config(adv=dict(estimator="action_norm", discount=0.9)))


# ---- KL in the reward: after normalisation and clip-filter weights -----------------------

@pytest.mark.parametrize("discount", [1.0, 0.9])
def test_kl_penalty_is_added_after_group_normalisation(tiny_model_dir, discount):
    model = _model(tiny_model_dir)
    ref_model = _model(tiny_model_dir)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    batch = _batch(model, noise=0.0)
    batch["rewards"][4:8] = 1.0  # the second group is flat
    kl_ctl = 0.3
    cfg = algorithm_config(**ON_POLICY, adv=dict(estimator="grpo", discount=discount), kl=dict(coef=kl_ctl, in_reward=True, estimator="k1"), filters=dict(clip_filter_weight=True, clip_filter_flat_weight=1.0))
    actor = PPOActor(RefEngine(model), cfg, ref=RefEngine(ref_model), tracker=StatsTracker())
    prepared = actor.compute_advantages(batch)

    r, g = batch["rewards"].tolist(), batch["group_id"].tolist()
    outcome = _grpo_ref(r, g, cfg.norm.eps)
    flat = {gi: len({r[j] for j in range(8) if g[j] == gi}) == 1 for gi in set(g)}
    w = min(len(flat) / (len(flat) - sum(flat.values())), cfg.filters.clip_filter_max_weight)
    for i in range(8):
        n = int(batch["attention_mask"][i].sum())
        ref_lp = _true_logprobs(ref_model, batch["input_ids"][i], n)
        ts = _trained(batch, i)
        kl = [float(batch["logprobs"][i, t]) - float(ref_lp[t]) for t in ts]  # k1
        weight = 1.0 if flat[g[i]] else w
        # seed 002: r_t = -kl_ctl * KL_t, plus the shaped score on the last token; G_t
        rtg, score = 0.0, None
        want = {}
        for t, k in reversed(list(zip(ts, kl, strict=True))):
            rtg = k + discount * rtg
            score = weight * outcome[i] if score is None else discount * score
            want[t] = score - kl_ctl * rtg
        for t in ts:
            assert float(prepared["advantages"][i, t - 1]) == pytest.approx(want[t], abs=2e-5)
    assert prepared["advantages"][4:8].abs().sum() > 0  # lambda = 1 keeps the KL signal


def test_token_estimators_keep_the_kl_inside_their_rewards(tiny_model_dir):
    """REINFORCE (token-level) by definition: G_t of r_t - kl_ctl * KL_t."""
    model = _model(tiny_model_dir)
    ref_model = _model(tiny_model_dir)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.mul_(0.9)
    batch = _batch(model, noise=0.0)
    cfg = algorithm_config(**ON_POLICY, adv=dict(estimator="reinforce", discount=0.8), kl=dict(coef=0.2, in_reward=True, estimator="k1"))
    prepared = PPOActor(RefEngine(model), cfg, ref=RefEngine(ref_model),
                        tracker=StatsTracker()).compute_advantages(batch)
    for i in range(8):
        n = int(batch["attention_mask"][i].sum())
        ref_lp = _true_logprobs(ref_model, batch["input_ids"][i], n)
        ts = _trained(batch, i)
        rewards = [-0.2 * (float(batch["logprobs"][i, t]) - float(ref_lp[t])) for t in ts]
        rewards[-1] += float(batch["rewards"][i])
        g = 0.0
        for t, rt in reversed(list(zip(ts, rewards, strict=True))):
            g = rt + 0.8 * g
            assert float(prepared["advantages"][i, t - 1]) == pytest.approx(g, abs=2e-5)


# ---- the entropy filter over the whole batch, across ranks ------------------------------

_ENTROPY_WORKER = """
import sys, torch, torch.distributed as dist
from areal_like.algorithms.filters import top_entropy_mask
rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
data = torch.load(out + "/data.pt")
rows = slice(0, 2) if rank == 0 else slice(2, 6)  # uneven shards
mask = top_entropy_mask(data["entropy"][rows], data["mask"][rows], 0.3, all_ranks=True)
torch.save(mask, f"{out}/rank{rank}.pt")
dist.destroy_process_group()
"""


def test_entropy_filter_selects_over_all_ranks(tmp_path):
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(6, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 7, generator=g) > 0.35
    torch.save({"entropy": entropy, "mask": mask}, tmp_path / "data.pt")
    (tmp_path / "worker.py").write_text(_ENTROPY_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r),
                               str(tmp_path / "init"), str(tmp_path)], env=env) for r in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)])
    cells = [(float(entropy[i, j]), i, j) for i in range(6) for j in range(7) if mask[i, j]]
    k = math.ceil(0.3 * len(cells))
    want = {(i, j) for _, i, j in sorted(cells, reverse=True)[:k]}
    assert {tuple(x) for x in got.nonzero().tolist()} == want


# ---- NaN / inf at masked positions never reach a loss or a gradient ----------------------

POISONS = [float("nan"), float("inf"), -float("inf")]


def _per_token_inputs(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "logp": -torch.rand(n, generator=g, dtype=torch.float64) * 3,
        "old": -torch.rand(n, generator=g, dtype=torch.float64) * 3,
        "behav": -torch.rand(n, generator=g, dtype=torch.float64) * 3,
        "adv": torch.randn(n, generator=g, dtype=torch.float64),
        "values": torch.randn(n, generator=g, dtype=torch.float64),
        "returns": torch.randn(n, generator=g, dtype=torch.float64),
    }


MASK = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
CU = torch.tensor([0, 5, 12])

LOSSES = {
    "ppo": lambda x, m: ppo_loss(x["logp"], x["old"], x["adv"], m, 0.2, 0.28, 3.0)[0],
    "decoupled": lambda x, m: decoupled_ppo_loss(x["logp"], x["old"], x["behav"], x["adv"], m,
                                                 0.2, None, None, 5.0)[0],
    "gspo": lambda x, m: gspo_loss(x["logp"], x["old"], x["adv"], m, CU, 0.1)[0],
    "cispo": lambda x, m: cispo_loss(x["logp"], x["old"], x["adv"], m, 10.0, 0.28)[0],
    "reinforce": lambda x, m: reinforce_loss(x["logp"], x["adv"], m)[0],
    "cpgd": lambda x, m: cpgd_loss(x["logp"], x["old"], x["adv"], m, 0.2, None, 0.1)[0],
    "value": lambda x, m: value_loss(x["values"], x["old"], x["returns"], m, 0.2)[0],
}


def _loss_and_grads(fn, inputs):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    loss = fn(leaves, MASK).sum()
    loss.backward()
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in leaves.items()}
    return loss.detach(), grads


@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_nan_and_inf_never_reach_a_loss_or_gradient(name, poison):
    clean = _per_token_inputs()
    want_loss, want_grads = _loss_and_grads(LOSSES[name], clean)
    dirty = {k: torch.where(MASK, v, torch.full_like(v, poison)) for k, v in clean.items()}
    got_loss, got_grads = _loss_and_grads(LOSSES[name], dirty)
    assert torch.isfinite(want_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for k in clean:
        assert torch.isfinite(got_grads[k]).all(), (name, k)
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=0, atol=0)


def _micro_batch(inputs, vocab=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = MASK.shape[0]
    return TensorDict({
        "input_ids": torch.randint(0, vocab, (n,), generator=g),
        "loss_mask": MASK.clone(), "cu_seqlens": CU.clone(),
        "advantages": inputs["adv"].float(), "old_logp": inputs["old"].float(),
        "prox_logp": inputs["old"].float(), "logprobs": inputs["behav"].float(),
        "ref_logp": inputs["behav"].float(), "values": inputs["values"].float(),
        "returns": inputs["returns"].float(),
    }, batch_size=[])


@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", [
    dict(loss=dict(policy="ppo", entropy_coef=0.01), kl=dict(coef=0.1, in_reward=False, estimator="k3"), off_policy=dict(decoupled=True, behav_imp_weight_cap=5.0)),
    dict(loss=dict(policy="gspo", agg_mode="seq-mean-token-mean"), kl=dict(coef=0.1, in_reward=False, estimator="k2")),
    dict(loss=dict(policy="cispo", eps_clip=10.0, eps_clip_high=0.28), off_policy=dict(decoupled=False)),
    dict(loss=dict(policy="reinforce", agg_mode="constant", agg_constant=8.0), off_policy=dict(decoupled=False)),
    dict(loss=dict(policy="cpgd", cpgd_drift_coef=0.1), off_policy=dict(decoupled=False)),
], ids=lambda c: c["loss"]["policy"])
def test_whole_loss_closures_ignore_poisoned_masked_positions(case, poison):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(MASK.shape[0], 11, generator=g)
    clean = _per_token_inputs(seed=2)
    results = []
    for inputs in (clean, {k: torch.where(MASK, v, torch.full_like(v, poison))
                           for k, v in clean.items()}):
        leaf = logits.clone().requires_grad_(True)
        # the closure's mask is the next-token mask: position t trains token t+1
        loss = make_policy_loss_fn(algorithm_config(**case), StatsTracker())(
            leaf, _micro_batch(inputs))
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (want, want_grad), (got, got_grad) = results
    assert torch.isfinite(want) and torch.isfinite(got_grad).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
    # the value loss closure too (critic output = the logits' first column)
    results = []
    for inputs in (clean, {k: torch.where(MASK, v, torch.full_like(v, poison))
                           for k, v in clean.items()}):
        leaf = logits[:, :1].clone().requires_grad_(True)
        loss = make_value_loss_fn(AlgorithmConfig(), StatsTracker())(leaf, _micro_batch(inputs))
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)


# ---- which algorithms need whole groups ---------------------------------------------------

@pytest.mark.parametrize("config,expected", [
    (algorithm_preset("grpo"), True), (algorithm_preset("dr_grpo"), True),
    (algorithm_preset("rloo"), True), (algorithm_preset("cpgd"), True),
    (algorithm_preset("dapo"), True), (algorithm_preset("gspo"), True),
    (algorithm_preset("remax"), False), (algorithm_preset("ppo"), False),
    (algorithm_preset("reinforce_pp", kl=dict(coef=0.0)), False),
    (algorithm_preset("ppo", norm=dict(level="group")), True),
    (algorithm_preset("remax", filters=dict(clip_filter_weight=True)), True),
    (algorithm_preset("ppo", filters=dict(dynamic_sampling=True)), True),
], ids=lambda x: "" if isinstance(x, bool) else x.adv.estimator)
def test_uses_group_statistics(config, expected):
    assert uses_group_statistics(config) is expected


def test_user_estimators_are_group_based_unless_declared(tiny_model_dir):
    @register_advantage_estimator("test_per_sample", group_based=False, kl_placement="outcome")
    def per_sample(inputs, config):
        raise AssertionError("not called")

    @register_advantage_estimator("test_unknown")
    def unknown(inputs, config):
        raise AssertionError("not called")

    try:
        assert not uses_group_statistics(algorithm_config(adv=dict(estimator="test_per_sample")))
        assert uses_group_statistics(algorithm_config(adv=dict(estimator="test_unknown")))
        with pytest.raises(ValueError, match="kl_placement"):
            register_advantage_estimator("test_bad", kl_placement="middle")
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_per_sample")
        ADVANTAGE_ESTIMATORS.unregister("test_unknown")
