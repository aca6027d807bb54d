"""recipes/ppo_prm.py end to end: real SGLang fleet, real trainer, a real PRM service (the
recipe starts it, or is given its URL), PPO with a critic on the PRM's step rewards."""

from __future__ import annotations

import pytest
from test_recipes import SMALL, _run_recipe

from areal_like.rewards.prm_model import build_prm
from areal_like.rewards.prm_server import PRMService

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

# the untrained policy writes random text: cut it at spaces so most completions have
# several steps; 2 epochs x 2 mini-batches per step for actor and critic
PRM_ARGS = [*SMALL, "gconfig.n_samples=2", "gconfig.max_new_tokens=8",
            "prm.step_delimiter=' '", "algorithm.update.epochs=2",
            "algorithm.update.n_minibatches=2"]


@pytest.mark.parametrize("how", ["recipe_starts_it", "given_url"])
def test_ppo_prm_recipe_trains_on_step_rewards(how, sglang_fleet, tiny_model_dir, tmp_path):
    prm_dir = build_prm(tmp_path / "prm", seed=2)
    if how == "given_url":
        with PRMService(prm_dir, startup_timeout=120) as svc:
            records = _run_recipe("ppo_prm", sglang_fleet, tiny_model_dir, tmp_path / "logs",
                                  *PRM_ARGS, f"prm.url={svc.url}", "prm.model_path=''")
    else:
        records = _run_recipe("ppo_prm", sglang_fleet, tiny_model_dir, tmp_path / "logs",
                              *PRM_ARGS, f"prm.model_path={prm_dir}")
    assert [r["step"] for r in records] == [0, 1, 2]
    last = records[-1]
    assert last["update_successful"] == 1.0 and last["n_tokens"] > 0
    assert "critic/loss" in last and "eval/accuracy" in last
    assert last["rollout/version"] >= 1
    # the training reward is the sum of PRM step rewards (score in (0, 1) minus the shipped
    # prm.score_offset=0.5), at most 8 steps: not the verifier's 0/1 (never earned here)
    for r in records[1:]:
        assert -4.0 <= r["actor/task_reward/avg"] <= 4.0
        assert r["actor/task_reward/avg"] != round(r["actor/task_reward/avg"])
