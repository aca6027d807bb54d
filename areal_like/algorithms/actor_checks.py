"""The combinations of `AlgorithmConfig` an actor refuses, checkable before any process starts
(the launcher runs them on the config; `PPOActor` runs them when it is built)."""

from __future__ import annotations

from areal_like.algorithms.corrections import TOKEN_LEVEL
from areal_like.algorithms.registry import (
    estimator_traits,
    get_advantage_estimator,
    get_policy_loss,
)
from areal_like.api.config import AlgorithmConfig


def check_actor_config(config: AlgorithmConfig, has_ref: bool) -> None:
    """KeyError for an unregistered name (listing the registered ones), ValueError for a
    combination the actor cannot train with; `has_ref`: a reference model is configured."""
    get_advantage_estimator(config.adv.estimator)
    if config.adv.discount < 1.0 and not estimator_traits(config.adv.estimator).discounted:
        raise ValueError(f"algorithm.adv.discount={config.adv.discount} means nothing to "
                         f"algorithm.adv.estimator={config.adv.estimator!r} (it does not "
                         f"discount); set algorithm.adv.discount=1.0")
    if config.kl.discount is not None \
            and estimator_traits(config.adv.estimator).kl_placement != "outcome":
        raise ValueError(f"algorithm.kl.discount={config.kl.discount} is for outcome "
                         f"estimators (grpo, rloo, ...); algorithm.adv.estimator="
                         f"{config.adv.estimator!r} takes the KL inside its token rewards and "
                         f"discounts them by algorithm.adv.discount: leave kl.discount unset")
    get_policy_loss(config.loss.policy)
    if config.loss.policy == "gspo" and config.off_policy.correction in TOKEN_LEVEL:
        raise ValueError(f"algorithm.off_policy.correction={config.off_policy.correction!r} "
                         f"weights tokens one by one, but algorithm.loss.policy='gspo' takes "
                         f"one ratio per sequence: use correction='mis_seq' (or 'none')")
    if config.kl.coef > 0 and not has_ref:
        raise ValueError(f"algorithm.kl.coef={config.kl.coef} needs a reference model: "
                         "set use_ref_model=true (recipes; PPOActor: pass ref=<TrainEngine>) "
                         "or algorithm.kl.coef=0")
    if config.loss.agg_mode == "constant" and config.loss.agg_constant is None:
        raise ValueError("algorithm.loss.agg_mode='constant' needs "
                         "algorithm.loss.agg_constant: set it to the generation budget "
                         "(gconfig.max_new_tokens; recipe configs fill it in)")
    if config.shaping.overlong_penalty and config.shaping.max_response_tokens <= 0:
        raise ValueError("algorithm.shaping.overlong_penalty=True needs "
                         "algorithm.shaping.max_response_tokens > 0: set it to the generation "
                         "budget (gconfig.max_new_tokens; recipe configs fill it in)")
    if config.filters.clip_filter_weight and config.adv.estimator == "cpgd":
        raise ValueError("adv_estimator='cpgd' already applies clip-filter weights; "
                         "set clip_filter_weight=False")
