"""PPOActor end to end on the reference engine of tests/test_algo_ref_engine.py.

Loss values and gradients through packed micro-batches are compared with float64 references
computed directly on the padded batch with per-token loops (the formulas of losses.py).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_algo_ref_engine import RefEngine, _batch, _grads, _model, _true_logprobs

from areal_like.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutputs,
    PPOActor,
    algorithm_preset,
    broadcast_to_tokens,
    register_advantage_estimator,
)
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.utils.stats_tracker import StatsTracker


def _grpo_ref(rewards, groups, eps):
    out = []
    for i, gi in enumerate(groups):
        m = [rewards[j] for j in range(len(rewards)) if groups[j] == gi]
        mu = sum(m) / len(m)
        sd = math.sqrt(sum((x - mu) ** 2 for x in m) / len(m))
        out.append(0.0 if max(m) == min(m) else (rewards[i] - mu) / (sd + eps))
    return out


def _entropy(logp_row):
    return -(logp_row.exp() * logp_row).sum()


def _entropy_keep(model, batch, ratio):
    """{(row, token)} of the top ceil(ratio * n) trained tokens of the whole batch by the
    entropy of `model`'s next-token distribution (float64 loops)."""
    flat = []
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        with torch.no_grad():
            logp_all = torch.log_softmax(model(input_ids=batch["input_ids"][i][None, :n])
                                         .logits[0].double(), -1)
        flat += [(i, t, float(_entropy(logp_all[t - 1]))) for t in range(1, n)
                 if batch["loss_mask"][i, t]]
    k = math.ceil(ratio * len(flat))
    return {(i, t) for i, t, _ in sorted(flat, key=lambda x: -x[2])[:k]}


def _reference_loss(model, batch, prox_next, cfg, adv, ref_model=None, keep=None):
    """Float64 loss from the padded batch with per-token loops (the formulas of losses.py).
    `keep`: the tokens the entropy filter selected (default: selected with `model`)."""
    eps_h = cfg.loss.eps_clip if cfg.loss.eps_clip_high is None else cfg.loss.eps_clip_high
    rows = []
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i]
        logp_all = torch.log_softmax(model(input_ids=ids[None, :n]).logits[0], -1)
        ref_all = (torch.log_softmax(ref_model(input_ids=ids[None, :n]).logits[0], -1).detach()
                   if ref_model is not None else None)
        # token t is predicted at position t - 1
        rows.append([(i, t, logp_all, ref_all) for t in range(1, n) if batch["loss_mask"][i, t]])
    if cfg.loss.top_entropy_ratio < 1:
        keep = _entropy_keep(model, batch, cfg.loss.top_entropy_ratio) if keep is None else keep
        rows = [[x for x in r if (x[0], x[1]) in keep] for r in rows]
    per_seq = []
    for i, row in enumerate(rows):
        ids = batch["input_ids"][i]
        terms, log_ratios = [], []
        for _, t, logp_all, ref_all in row:
            lp = logp_all[t - 1, ids[t]]
            prox = float(prox_next[i, t - 1])
            behav = float(batch["logprobs"][i, t])
            ref = None if ref_all is None else float(ref_all[t - 1, ids[t]])
            log_ratios.append(lp - prox)
            terms.append((lp, prox, behav, logp_all[t - 1], ref))
        seq_ratio = torch.exp(torch.stack(log_ratios).mean()) if row else None
        losses = []
        for lp, prox, behav, dist, ref in terms:
            a = adv[i]
            r = seq_ratio if cfg.loss.policy == "gspo" else torch.exp(lp - prox)
            if cfg.loss.policy in ("ppo", "gspo"):
                loss = torch.maximum(-a * r, -a * r.clamp(1 - cfg.loss.eps_clip, 1 + eps_h))
                if cfg.loss.c_clip is not None and a < 0:
                    loss = torch.minimum(loss, torch.tensor(-a * cfg.loss.c_clip, dtype=loss.dtype))
            elif cfg.loss.policy == "cispo":
                loss = -r.detach().clamp(1 - cfg.loss.eps_clip, 1 + eps_h) * a * lp
            else:  # reinforce
                loss = -a * lp
            if cfg.off_policy.decoupled:
                w = math.exp(prox - behav)
                cap = cfg.off_policy.behav_imp_weight_cap
                loss = loss * (0.0 if cap is not None and w > cap else w)
            if cfg.loss.entropy_coef:
                loss = loss - cfg.loss.entropy_coef * _entropy(dist)
            if cfg.kl.coef and not cfg.kl.in_reward:  # k3 = pi_ref/pi - 1 - log(pi_ref/pi)
                loss = loss + cfg.kl.coef * (torch.exp(ref - lp) - 1 - (ref - lp))
            losses.append(loss)
        per_seq.append(losses)
    nonempty = [s for s in per_seq if s]
    if cfg.loss.agg_mode == "token-mean":
        return sum(sum(s) for s in nonempty) / sum(len(s) for s in nonempty)
    if cfg.loss.agg_mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in nonempty) / len(nonempty)
    if cfg.loss.agg_mode == "seq-mean-token-sum":
        return sum(sum(s) for s in nonempty) / len(nonempty)
    return sum(sum(s) for s in nonempty) / (len(nonempty) * cfg.loss.agg_constant)


CASES = [
    dict(loss=dict(policy="ppo", agg_mode="token-mean")),
    dict(loss=dict(policy="ppo", agg_mode="seq-mean-token-mean"), off_policy=dict(behav_imp_weight_cap=1.5)),
    dict(loss=dict(policy="ppo", agg_mode="seq-mean-token-sum", eps_clip_high=0.28, c_clip=1.1)),
    dict(loss=dict(policy="ppo", agg_mode="constant", agg_constant=6.0, entropy_coef=0.01)),
    dict(loss=dict(policy="gspo", agg_mode="seq-mean-token-mean", eps_clip=0.05)),
    dict(loss=dict(policy="cispo", agg_mode="token-mean"), off_policy=dict(decoupled=False)),
    dict(loss=dict(policy="reinforce", agg_mode="token-mean"), off_policy=dict(decoupled=False)),
    # the entropy filter selects over the whole batch, not per micro-batch
    dict(loss=dict(policy="ppo", agg_mode="token-mean", top_entropy_ratio=0.5), kl=dict(coef=0.1, estimator="k3")),
    dict(loss=dict(policy="ppo", agg_mode="seq-mean-token-mean", top_entropy_ratio=0.3)),
]


def _perturbed_model(path, scale=0.05):
    model = _model(path)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['loss']['policy']}-{c['loss']['agg_mode']}")
def test_policy_loss_through_packed_micro_batches_matches_padded_reference(tiny_model_dir, case):
    case = dict(case)
    one_mb = case.pop("one_micro_batch", False)
    model = _model(tiny_model_dir)
    ref_model = _perturbed_model(tiny_model_dir) if case.get("kl", {}).get("coef") else None
    batch = _batch(model, noise=0.3)
    g = torch.Generator().manual_seed(7)
    # a given proximal policy (next-token aligned) so that ratios move away from 1
    prox = torch.where(batch["attention_mask"], torch.zeros(batch["input_ids"].shape), 0.0)
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        lp = _true_logprobs(model, batch["input_ids"][i], n)
        prox[i, :n - 1] = (lp[1:] + 0.2 * torch.randn(n - 1, generator=g,
                                                      dtype=torch.float64)).float()
    batch["prox_logp"] = prox
    cfg = algorithm_config(group_size=4, **case, adv=dict(estimator="grpo"))
    engine = RefEngine(model, lr=0.0, max_tokens_per_mb=1000 if one_mb else 24)
    tracker = StatsTracker()
    ref = RefEngine(ref_model) if ref_model is not None else None
    stats = PPOActor(engine, cfg, ref=ref, tracker=tracker).update(batch)
    assert engine.n_micro_batches == 1 if one_mb else engine.n_micro_batches >= 3
    got_grad = _grads(model).clone()

    adv = _grpo_ref(batch["rewards"].tolist(), batch["group_id"].tolist(), cfg.norm.eps)
    model.zero_grad()
    want = _reference_loss(model, batch, prox, cfg, adv, ref_model)
    want.backward()
    assert stats["loss"] == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_grad, _grads(model), rtol=1e-4, atol=1e-6)

    exported = tracker.export()
    for key in ("actor/update/importance_weight/max", "actor/update/approx_kl/avg",
                "actor/update/clip_ratio/avg", "actor/update/entropy/avg",
                "actor/advantages/avg", "actor/task_reward/avg", "actor/response_length/max"):
        assert math.isfinite(exported[key]), key
    if cfg.off_policy.decoupled:
        assert exported["actor/update/behav_imp_weight/max"] > 0
        if cfg.off_policy.behav_imp_weight_cap:
            assert exported["actor/update/behav_capped_ratio/avg"] > 0
    if cfg.loss.c_clip is not None:
        assert exported["actor/update/dual_clip_ratio/avg"] > 0  # the dual clip did bind


def test_recomputed_logprobs_align_with_behaviour_logprobs(tiny_model_dir):
    """Behaviour log-probs from the same weights: the decoupled weight must be exactly ~1
    (two optimizer steps per batch: the proximal log-probs are recomputed before the first)."""
    model = _model(tiny_model_dir)
    batch = _batch(model, noise=0.0)
    tracker = StatsTracker()
    actor = PPOActor(RefEngine(model, max_tokens_per_mb=24),
                     algorithm_config(group_size=4, update=dict(n_minibatches=2)),
                     tracker=tracker)
    prepared = actor.compute_advantages(batch)
    m = prepared["loss_mask"]
    assert int(m.sum()) == int(batch["loss_mask"].sum())  # every trained token kept, shifted
    torch.testing.assert_close(prepared["prox_logp"][m], prepared["logprobs"][m], rtol=0,
                               atol=2e-5)
    assert "advantages" not in batch.keys()  # the input batch is untouched
    with pytest.raises(ValueError, match="already prepared"):
        actor.compute_advantages(prepared)


def _counted_forward(engine, calls, *args, **kwargs):
    calls.append(args)
    return RefEngine.forward(engine, *args, **kwargs)


def test_a_one_step_update_takes_the_proximal_logprobs_from_its_own_forward(tiny_model_dir):
    """One optimizer step per batch: no separate forward, and the same update, decoupled
    weights and train/inference gap as with the proximal log-probs recomputed first."""
    batch = _batch(_model(tiny_model_dir, torch.float64), noise=0.3)  # behaviour != current
    batch["versions"] = torch.where(batch["loss_mask"], torch.arange(8)[:, None] % 3, -1)
    config = algorithm_config(group_size=4, off_policy=dict(behav_imp_weight_cap=1.5))
    runs = {}
    for name in ("from_update", "recomputed"):
        model = _model(tiny_model_dir, torch.float64)
        engine, tracker = RefEngine(model, lr=1.0, max_tokens_per_mb=24), StatsTracker()
        engine.set_version(2)
        actor = PPOActor(engine, config, tracker=tracker)
        given = batch.clone()
        if name == "recomputed":
            given["prox_logp"] = actor.compute_logp(given)
        forwards: list[object] = []
        engine.forward = functools.partial(_counted_forward, engine, forwards)
        actor.update(given)
        runs[name] = (forwards, tracker.export(), [p.detach().clone() for p in model.parameters()])
    (forwards, got, params), (_, want, want_params) = runs["from_update"], runs["recomputed"]
    assert forwards == []  # nothing but the update's own forward and backward
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    gap_keys = [k for k in want if k.startswith("actor/gap/")]
    assert "actor/gap/lag2/abs_log_diff/avg" in gap_keys and "actor/gap/k3/avg" in gap_keys
    assert sorted(k for k in got if k.startswith("actor/gap/")) == sorted(gap_keys)
    for key in gap_keys + ["actor/update/behav_imp_weight/avg", "actor/update/behav_capped_ratio/avg",
                           "actor/update/importance_weight/max", "actor/update/approx_kl/avg"]:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    # two optimizer steps need them before the first: a batch prepared without them is refused
    two_steps = PPOActor(RefEngine(_model(tiny_model_dir)),
                         algorithm_config(group_size=4, update=dict(n_minibatches=2)),
                         tracker=StatsTracker())
    prepared = PPOActor(RefEngine(_model(tiny_model_dir)), config,
                        tracker=StatsTracker()).compute_advantages(batch)
    assert "prox_logp" not in prepared.keys() and "version_lag" in prepared.keys()
    with pytest.raises(ValueError, match="n_minibatches=2"):
        two_steps.update(prepared)


def test_grpo_update_raises_the_rewarded_completion(tiny_model_dir):
    model = _model(tiny_model_dir, torch.float32)
    engine = RefEngine(model, lr=3e-3, adam=True, max_tokens_per_mb=24)
    actor = PPOActor(engine, algorithm_preset("grpo", group_size=4), tracker=StatsTracker())
    batch = _batch(model, n_rows=4, group=4)  # rewards [1, 0, 0, 0]

    def seq_logp():
        return torch.stack([_true_logprobs(model, batch["input_ids"][i],
                                           int(batch["attention_mask"][i].sum()))
                            [batch["loss_mask"][i, :int(batch["attention_mask"][i].sum())]].sum()
                            for i in range(4)])

    before = seq_logp()
    for _ in range(4):
        fresh = _batch(model, n_rows=4, group=4)  # on-policy behaviour log-probs each step
        actor.update(fresh)
    delta = seq_logp() - before
    assert delta[0] > 0.5 and (delta[1:] < 0).all(), delta.tolist()


def test_presets_run_an_update(tiny_model_dir):
    ref = RefEngine(_model(tiny_model_dir, torch.float32))
    for name in ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "remax", "cispo",
                 "cpgd"):
        model = _model(tiny_model_dir, torch.float32)
        # the overlong settings are read (and allowed) only where the preset penalises length
        shaping = dict(max_response_tokens=6, overlong_tokens=2) if name == "dapo" else {}
        cfg = algorithm_preset(name, group_size=4, shaping=shaping, loss=dict(agg_constant=6.0))
        tracker = StatsTracker()
        actor = PPOActor(RefEngine(model, lr=1e-4, max_tokens_per_mb=24), cfg,
                         ref=ref if cfg.kl.coef else None, tracker=tracker)
        stats = actor.update(_batch(model, seed=3))
        out = tracker.export()
        assert math.isfinite(stats["loss"]), name
        assert all(math.isfinite(v) for v in out.values()), name
        if name == "reinforce_pp":  # same weights as the reference: KL ~ 0
            assert abs(out["actor/kl_ref/avg"]) < 1e-5
        if name == "dapo":
            assert out["actor/n_groups_kept"] + out["actor/n_groups_dropped"] == 2
    with pytest.raises(ValueError, match="reference model"):
        PPOActor(RefEngine(model), algorithm_preset("reinforce_pp"))


def test_entropy_filter_uses_the_entropy_recorded_when_the_batch_was_prepared(tiny_model_dir):
    """The selection is made once, at compute_advantages, with the policy of that moment; a
    later change of the weights does not change which tokens are trained."""
    model = _model(tiny_model_dir)
    batch = _batch(model, noise=0.3)
    cfg = algorithm_config(group_size=4, adv=dict(estimator="grpo"), loss=dict(top_entropy_ratio=0.4, agg_mode="token-mean"))
    engine = RefEngine(model, lr=0.0, max_tokens_per_mb=24)
    actor = PPOActor(engine, cfg, tracker=StatsTracker())
    keep = _entropy_keep(model, batch, cfg.loss.top_entropy_ratio)
    prepared = actor.compute_advantages(batch)
    got = {(i, t + 1) for i, t in prepared["policy_mask"].nonzero().tolist()}
    assert got == keep and len(keep) == math.ceil(0.4 * int(batch["loss_mask"].sum()))

    with torch.no_grad():  # the policy moves before the update
        for p in model.parameters():
            p.mul_(1.5)
    assert _entropy_keep(model, batch, cfg.loss.top_entropy_ratio) != keep  # a real change
    stats = actor.update(prepared)
    adv = _grpo_ref(batch["rewards"].tolist(), batch["group_id"].tolist(), cfg.norm.eps)
    want = _reference_loss(model, batch, prepared["prox_logp"], cfg, adv, keep=keep)
    assert stats["loss"] == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)


def test_user_registered_estimator_is_selected_by_config(tiny_model_dir):
    @register_advantage_estimator("test_half_reward")
    def half_reward(inputs, config):
        return AdvantageOutputs(broadcast_to_tokens(inputs.seq_rewards * 0.5, inputs.loss_mask))

    try:
        model = _model(tiny_model_dir)
        cfg = algorithm_config(adv=dict(estimator="test_half_reward"), off_policy=dict(decoupled=False, recompute_logprob=False))
        prepared = PPOActor(RefEngine(model), cfg, tracker=StatsTracker()).compute_advantages(
            _batch(model))
        m = prepared["loss_mask"]
        rows = m.nonzero()[:, 0]
        assert (prepared["advantages"][m] == 0.5 * _batch(model)["rewards"][rows]).all()
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_half_reward")
    with pytest.raises(KeyError, match="test_half_reward"):
        PPOActor(RefEngine(model), cfg)


def test_behaviour_logprobs_are_needed_only_by_the_corrections_that_use_them(tiny_model_dir):
    """A trajectory without `logprobs` (AReaL-lite's custom-loss workflows return none) trains
    on-policy PPO with recomputed old log-probs exactly as with them; decoupled PPO, or PPO
    that takes the server's log-probs as old ones, refuses it naming the key and the flag."""
    batch = _batch(_model(tiny_model_dir, torch.float32), seed=5)
    losses = []
    for drop in (False, True):
        model = _model(tiny_model_dir, torch.float32)
        cfg = algorithm_preset("grpo", group_size=4, off_policy=dict(decoupled=False, recompute_logprob=True))
        actor = PPOActor(RefEngine(model, lr=1e-4, max_tokens_per_mb=24), cfg,
                         tracker=StatsTracker())
        given = batch.clone()
        if drop:
            del given["logprobs"]
        losses.append(actor.update(given)["loss"])
    assert math.isfinite(losses[0]) and losses[1] == pytest.approx(losses[0], rel=1e-6)
    without = batch.clone()
    del without["logprobs"]
    for flags, named in (({"decoupled": True, "recompute_logprob": True},
                          "algorithm.off_policy.decoupled=true"),
                         ({"decoupled": False, "recompute_logprob": False},
                          "algorithm.off_policy.recompute_logprob=false")):
        actor = PPOActor(RefEngine(_model(tiny_model_dir, torch.float32)),
                         algorithm_preset("grpo", group_size=4, off_policy=flags),
                         tracker=StatsTracker())
        with pytest.raises(ValueError, match=f"no 'logprobs' .*which {named} needs"):
            actor.update(without.clone())
