"""Algorithms: functional losses, advantage estimators, registries and thin actors.

An algorithm is an advantage estimator + a policy loss + a loss aggregation, chosen by name in
`AlgorithmConfig` and wired by a thin actor that hands `loss_fn` to `TrainEngine.train_batch`.
Importing this package registers the built-in estimators and losses; the actors and filters
(which need tensordict) load on first use, so a config check (the launcher's) needs torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_like.algorithms import action_norm as _action_norm  # noqa: F401  (registers)
from areal_like.algorithms import estimators as _estimators  # noqa: F401  (registers)
from areal_like.algorithms import losses as _losses  # noqa: F401  (registers)
from areal_like.algorithms.actor_checks import check_actor_config
from areal_like.algorithms.advantages import broadcast_to_tokens, discounted_returns
from areal_like.algorithms.aggregation import aggregate_loss, loss_weight
from areal_like.algorithms.estimators import AdvantageInputs, AdvantageOutputs
from areal_like.algorithms.losses import PolicyLossInputs
from areal_like.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    EstimatorTraits,
    estimator_traits,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
    uses_group_statistics,
)
from areal_like.api.algorithm_presets import (
    PRESETS,
    algorithm_config,
    algorithm_preset,
    register_algorithm_preset,
)
from areal_like.lazy import LazyExports

if TYPE_CHECKING:
    from areal_like.algorithms.actors import CriticActor, PPOActor, ReinforceActor, SFTActor
    from areal_like.algorithms.filters import (
        ZeroVarianceGroupFilter,
        drop_zero_variance_groups,
        dynamic_sampling_filter,
    )

_LAZY = LazyExports(__name__, {
    **dict.fromkeys(["CriticActor", "PPOActor", "ReinforceActor", "SFTActor"],
                    "areal_like.algorithms.actors"),
    **dict.fromkeys(["ZeroVarianceGroupFilter", "drop_zero_variance_groups",
                     "dynamic_sampling_filter"], "areal_like.algorithms.filters")})


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.dir()


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "AdvantageOutputs",
    "CriticActor",
    "EstimatorTraits",
    "POLICY_LOSSES",
    "PPOActor",
    "PRESETS",
    "PolicyLossInputs",
    "ReinforceActor",
    "SFTActor",
    "ZeroVarianceGroupFilter",
    "aggregate_loss",
    "algorithm_config",
    "algorithm_preset",
    "broadcast_to_tokens",
    "check_actor_config",
    "discounted_returns",
    "drop_zero_variance_groups",
    "dynamic_sampling_filter",
    "estimator_traits",
    "get_advantage_estimator",
    "get_policy_loss",
    "loss_weight",
    "register_advantage_estimator",
    "register_algorithm_preset",
    "register_policy_loss",
    "uses_group_statistics",
]
