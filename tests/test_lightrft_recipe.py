"""GRPO under LightRFT's names (group_norm, unbiased group std) with a remote reward model
and an adaptive KL controller, end to end: real SGLang fleet, torchrun-free one-process trainer
(`python -m recipes.grpo`), the real `rm_server` process scoring every sample."""

from __future__ import annotations

import pytest
from test_recipes import SMALL, _run_recipe
from test_remote_rm import RMServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


def test_grpo_with_remote_rm_and_adaptive_kl(sglang_fleet, tiny_model_dir, tmp_path):
    server = RMServer()
    try:
        records = _run_recipe(
            "grpo", sglang_fleet, tiny_model_dir, tmp_path, *SMALL, "gconfig.n_samples=4",
            "algorithm.adv.estimator=group_norm", "algorithm.adv.group_std=unbiased",
            "use_ref_model=true", f"ref.model.path={tiny_model_dir}",
            "algorithm.kl.coef=0.05", "algorithm.kl.target=0.001", "algorithm.kl.horizon=100",
            "algorithm.kl.estimator=k3", f"reward.remote_rm_url={server.url}",
            # the untrained model earns no reward: the entropy bonus moves the weights, so the
            # policy drifts from the reference and the controller sees KL > 0
            "actor.optimizer.lr=1e-3", "algorithm.loss.entropy_coef=0.05", steps=3)
        stats = server.stats()
    finally:
        server.close()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # every training sample (3 steps x 2 prompts x 4) and evaluation was scored remotely
    assert sum(stats["batch_sizes"]) >= 24 and stats["requests"] >= 6
    coefs = [r["actor/kl_coef"] for r in records[1:]]
    kls = [r["actor/kl_observed"] for r in records[1:]]
    # replay the controller on the observed KLs: beta_k = beta_{k-1}(1 + clip(kl/t - 1) n/H)
    beta = 0.05
    for kl, coef in zip(kls, coefs, strict=True):
        beta *= 1 + max(-0.2, min(0.2, kl / 0.001 - 1)) * 8 / 100
        assert coef == pytest.approx(beta, rel=1e-5)
    assert max(kls) > 0
    assert records[-1]["update_successful"] == 1.0
