"""The combinations of `AlgorithmConfig` an actor refuses, checkable before any process starts
(the launcher runs them on the config; `PPOActor` runs them when it is built)."""

from __future__ import annotations

from areal_like.algorithms.registry import get_advantage_estimator, get_policy_loss
from areal_like.api.config import AlgorithmConfig


def check_actor_config(config: AlgorithmConfig, has_ref: bool) -> None:
    """KeyError for an unregistered name (listing the registered ones), ValueError for a
    combination the actor cannot train with; `has_ref`: a reference model is configured."""
    get_advantage_estimator(config.adv_estimator)
    get_policy_loss(config.policy_loss)
    if config.kl_ctl > 0 and not has_ref:
        raise ValueError(f"AlgorithmConfig.kl_ctl={config.kl_ctl} needs a reference model: "
                         "set use_ref_model=true (recipes; PPOActor: pass ref=<TrainEngine>) "
                         "or algorithm.kl_ctl=0")
    if config.loss_agg_mode == "constant" and config.loss_agg_constant is None:
        raise ValueError("AlgorithmConfig.loss_agg_mode='constant' needs "
                         "AlgorithmConfig.loss_agg_constant: set it to the generation budget "
                         "(gconfig.max_new_tokens; recipe configs fill it in)")
    if config.overlong_reward_penalty and config.max_response_tokens <= 0:
        raise ValueError("AlgorithmConfig.overlong_reward_penalty=True needs "
                         "AlgorithmConfig.max_response_tokens > 0: set it to the generation "
                         "budget (gconfig.max_new_tokens; recipe configs fill it in)")
    if config.clip_filter_weight and config.adv_estimator == "cpgd":
        raise ValueError("adv_estimator='cpgd' already applies clip-filter weights; "
                         "set clip_filter_weight=False")
