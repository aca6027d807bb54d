"""Named algorithms as `AlgorithmConfig` settings: an algorithm is configuration alone.

    config = algorithm_preset("dapo", max_response_tokens=256, overlong_tokens=64)

    preset        estimator     policy loss  aggregation          notes
    grpo          grpo          ppo          seq-mean-token-mean
    dr_grpo       dr_grpo       ppo          constant             loss_agg_constant = the
                                                                  generation budget
    dapo          grpo          ppo          token-mean           clip-higher 0.2/0.28, overlong
                                                                  penalty, dynamic sampling
    rloo          rloo          ppo          token-mean
    reinforce_pp  reinforce_pp  ppo          token-mean           token KL in reward (needs ref)
    gspo          grpo          gspo         seq-mean-token-mean  eps 3e-4 / 4e-4
    remax         remax         reinforce    token-mean           A = shape(r) - shape(r_greedy)
    ppo           gae           ppo          token-mean           with CriticActor values
    cispo         grpo          cispo        token-mean           upper clip only (eps_h 0.28)
    cpgd          cpgd          cpgd         token-mean           policy-drift coef 0.1

`reinforce_pp` sets kl_ctl=0.01 with kl_in_reward: give PPOActor a reference engine, or
override kl_ctl=0. `dr_grpo` needs loss_agg_constant and `dapo` max_response_tokens (both the
generation budget, gconfig.max_new_tokens; recipe configs fill them in when unset) and
overlong_tokens (the soft interval).
"""

from __future__ import annotations

from typing import Any

from areal_like.api.config import AlgorithmConfig

# on-policy REINFORCE-style estimators do not need the decoupled correction
_ON_POLICY = dict(use_decoupled_loss=False, recompute_logprob=False)

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(adv_estimator="grpo", policy_loss="ppo", loss_agg_mode="seq-mean-token-mean"),
    "dr_grpo": dict(adv_estimator="dr_grpo", policy_loss="ppo", loss_agg_mode="constant"),
    "dapo": dict(adv_estimator="grpo", policy_loss="ppo", loss_agg_mode="token-mean",
                 eps_clip=0.2, eps_clip_high=0.28, overlong_reward_penalty=True,
                 dynamic_sampling=True),
    "rloo": dict(adv_estimator="rloo", policy_loss="ppo", loss_agg_mode="token-mean"),
    "reinforce_pp": dict(adv_estimator="reinforce_pp", policy_loss="ppo",
                         loss_agg_mode="token-mean", kl_ctl=0.01, kl_in_reward=True,
                         kl_estimator="k1"),
    "gspo": dict(adv_estimator="grpo", policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                 eps_clip=3e-4, eps_clip_high=4e-4),
    "remax": dict(adv_estimator="remax", policy_loss="reinforce", loss_agg_mode="token-mean",
                  **_ON_POLICY),
    "ppo": dict(adv_estimator="gae", policy_loss="ppo", loss_agg_mode="token-mean",
                adv_norm_level="batch"),
    "cispo": dict(adv_estimator="grpo", policy_loss="cispo", loss_agg_mode="token-mean",
                  eps_clip=10.0, eps_clip_high=0.28),
    "cpgd": dict(adv_estimator="cpgd", policy_loss="cpgd", loss_agg_mode="token-mean",
                 cpgd_drift_coef=0.1),
}


def algorithm_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """`AlgorithmConfig` of preset `name`, with `overrides` applied on top."""
    if name not in PRESETS:
        raise KeyError(f"unknown algorithm preset {name!r}; choose one of {sorted(PRESETS)}")
    return AlgorithmConfig(**{**PRESETS[name], **overrides})
