"""CriticActor, SFTActor, the two-class ReinforceActor example and PPOActor options, on the
reference engine of tests/test_algo_ref_engine.py."""

from __future__ import annotations

import pytest
import torch
from test_algo_ref_engine import RefEngine, _batch, _model, _true_logprobs
from transformers import AutoModelForTokenClassification

from areal_like.algorithms import (
    CriticActor,
    PPOActor,
    ReinforceActor,
    SFTActor,
    algorithm_preset,
)
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.api.config import AlgorithmConfig
from areal_like.utils.stats_tracker import StatsTracker


def test_critic_gae_with_dense_rewards_and_value_learning(tiny_model_dir):
    torch.manual_seed(0)
    critic_model = AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1).double()
    policy = _model(tiny_model_dir)
    batch = _batch(policy, dense=True)
    cfg = algorithm_preset("ppo", adv=dict(discount=0.9, gae_lambda=0.8), norm=dict(level="none"), loss=dict(value_eps_clip=1.0))
    critic = CriticActor(RefEngine(critic_model, lr=1e-3, adam=True, max_tokens_per_mb=24), cfg,
                         tracker=StatsTracker())
    actor = PPOActor(RefEngine(policy, max_tokens_per_mb=24), cfg, tracker=StatsTracker())
    batch["values"] = critic.compute_values(batch)
    prepared = actor.compute_advantages(batch)
    # reference GAE on next-token aligned data: action at position t - 1 generates token t
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        pos = [t - 1 for t in range(1, n) if batch["loss_mask"][i, t]]
        next_v = next_a = 0.0
        for p in reversed(pos):
            v = float(batch["values"][i, p])
            a = float(batch["rewards"][i, p + 1]) + 0.9 * next_v - v + 0.9 * 0.8 * next_a
            assert float(prepared["advantages"][i, p]) == pytest.approx(a, rel=1e-5, abs=1e-5)
            next_v, next_a = v, a
    losses = [critic.update(prepared)["loss"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], losses


class RefReinforceActor(RefEngine):
    """The two-class pattern: a backend engine that owns a backend-agnostic actor."""

    def __init__(self, model, config):
        super().__init__(model, lr=0.0, max_tokens_per_mb=24)
        self.actor = ReinforceActor(self, config, tracker=StatsTracker())

    def update(self, batch):
        return self.actor.update(batch)


def test_reinforce_actor_two_class_example(tiny_model_dir):
    model = _model(tiny_model_dir)
    batch = _batch(model)
    batch["baseline_rewards"] = torch.full((batch.shape[0],), 0.25)
    stats = RefReinforceActor(model, AlgorithmConfig()).update(batch)
    total, count = 0.0, 0
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        lp = _true_logprobs(model, batch["input_ids"][i], n)
        a = float(batch["rewards"][i]) - 0.25
        for t in range(n):
            if batch["loss_mask"][i, t]:
                total, count = total - a * float(lp[t]), count + 1
    assert stats["loss"] == pytest.approx(total / count, rel=1e-5)


def test_sft_actor_matches_nll_and_learns(tiny_model_dir):
    model = _model(tiny_model_dir, torch.float32)
    batch = _batch(model)
    actor = SFTActor(RefEngine(model, lr=3e-3, adam=True, max_tokens_per_mb=24),
                     tracker=StatsTracker())
    nll = [-float(_true_logprobs(model, batch["input_ids"][i], int(batch["attention_mask"][i]
                                                                  .sum()))[t])
           for i in range(batch.shape[0]) for t in range(int(batch["attention_mask"][i].sum()))
           if batch["loss_mask"][i, t]]
    assert actor.evaluate(batch)["loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-4)
    losses = [actor.update(batch)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


def test_actor_options_running_norm_clip_filter_minibatches_and_version_lag(tiny_model_dir):
    model = _model(tiny_model_dir)
    on_policy = dict(group_size=4, off_policy=dict(decoupled=False, recompute_logprob=False))
    batches = [_batch(model, seed=s) for s in (1, 2)]
    # running (cross-batch) normalisation: the 2nd batch is normalised with both batches' stats
    actor = PPOActor(RefEngine(model), algorithm_config(**on_policy, adv=dict(estimator="dr_grpo"), norm=dict(level="running")),
                     tracker=StatsTracker())
    raw_actor = PPOActor(RefEngine(model), algorithm_config(**on_policy, adv=dict(estimator="dr_grpo")),
                         tracker=StatsTracker())
    raw = [raw_actor.compute_advantages(b) for b in batches]
    got = [actor.compute_advantages(b) for b in batches][1]
    pooled = torch.cat([r["advantages"][r["loss_mask"]].double() for r in raw])
    mu, sd = pooled.mean(), pooled.std(unbiased=False)
    m = got["loss_mask"]
    torch.testing.assert_close(got["advantages"][m].double(),
                               (raw[1]["advantages"][m].double() - mu) / (sd + 1e-5),
                               rtol=1e-5, atol=1e-6)
    # clip-filter weights multiply the advantages of groups with reward variance
    batch = batches[0]
    batch["rewards"][4:8] = 1.0  # second group flat
    weighted = PPOActor(RefEngine(model), algorithm_config(**on_policy, filters=dict(clip_filter_weight=True)),
                        tracker=StatsTracker()).compute_advantages(batch)
    plain = PPOActor(RefEngine(model), algorithm_config(**on_policy),
                     tracker=StatsTracker()).compute_advantages(batch)
    torch.testing.assert_close(weighted["advantages"][:4], 2.0 * plain["advantages"][:4])
    assert (weighted["advantages"][4:] == 0).all()
    # mini-batches: one optimizer step each; version lag reported per trained token
    engine, tracker = RefEngine(model, lr=0.0), StatsTracker()
    engine.set_version(3)
    calls = []
    engine.train_batch = lambda b, **kw: calls.append(b.shape[0]) or {"loss": 1.0}
    PPOActor(engine, algorithm_config(**on_policy, update=dict(n_minibatches=2)),
             tracker=tracker).update(batches[1])
    assert calls == [4, 4]
    assert tracker.export()["actor/version_lag/avg"] == 3.0
