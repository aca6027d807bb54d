"""Name -> function registries for advantage estimators and policy losses.

Users add their own with a decorator and select them by name in `AlgorithmConfig`:

    from areal_like.algorithms import register_advantage_estimator, AdvantageOutputs

    @register_advantage_estimator("my_baseline")
    def my_baseline(inputs, config):
        adv = inputs.seq_rewards - 0.5
        return AdvantageOutputs(advantages=broadcast_to_tokens(adv, inputs.loss_mask))

    algorithm_config(adv={"estimator": "my_baseline"})

Signatures: an advantage estimator is `fn(AdvantageInputs, AlgorithmConfig) ->
AdvantageOutputs` (see `estimators.py`); a policy loss is `fn(PolicyLossInputs,
AlgorithmConfig) -> (token_loss [T], stats)` (see `losses.py`).

An estimator declares two properties when registered (the defaults suit an unknown estimator):
`group_based` (True: it uses statistics of a prompt's samples, so a group with a failed sample
is dropped whole) and `kl_placement` ("token": a KL-in-reward penalty goes into the token
rewards before the estimator runs; "outcome": the estimator sees outcome rewards only and the
penalty's return-to-go is added to its advantages afterwards), and `discounted` (True: it
honours `algorithm.adv.discount`; False: a discount below 1 is refused, as it would mean
nothing to the estimator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, Literal, TypeVar

if TYPE_CHECKING:
    from areal_like.api.config import AlgorithmConfig

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A dict of named functions with a decorator to add to it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator: register the function under `name` (re-registering needs override)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def deco(fn: F) -> F:
            if name in self._entries and not override and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"({self._entries[name].__module__}."
                                 f"{self._entries[name].__qualname__}); pass override=True")
            self._entries[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}. "
                           f"Register one with @register_{self.kind.replace(' ', '_')}"
                           f"({name!r})")
        return self._entries[name]

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
KLPlacement = Literal["token", "outcome"]


@dataclass(frozen=True)
class EstimatorTraits:
    group_based: bool = True  # safe default: a partial group is never trained on
    kl_placement: KLPlacement = "token"
    discounted: bool = True  # honours algorithm.adv.discount (False: refused below 1)


_ESTIMATOR_TRAITS: dict[str, EstimatorTraits] = {}


def register_advantage_estimator(name: str, *, override: bool = False, group_based: bool = True,
                                 kl_placement: KLPlacement = "token",
                                 discounted: bool = True) -> Callable[[F], F]:
    """Decorator registering `fn(AdvantageInputs, AlgorithmConfig) -> AdvantageOutputs`
    (see the module docstring for `group_based`, `kl_placement` and `discounted`)."""
    if kl_placement not in ("token", "outcome"):
        raise ValueError(f"kl_placement={kl_placement!r}; choose 'token' or 'outcome'")
    register = ADVANTAGE_ESTIMATORS.register(name, override=override)

    def deco(fn: F) -> F:
        register(fn)
        _ESTIMATOR_TRAITS[name] = EstimatorTraits(group_based, kl_placement, discounted)
        return fn

    return deco


def estimator_traits(name: str) -> EstimatorTraits:
    """The declared properties of a registered estimator (KeyError naming the choices)."""
    ADVANTAGE_ESTIMATORS.get(name)
    return _ESTIMATOR_TRAITS.get(name, EstimatorTraits())


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering `fn(PolicyLossInputs, AlgorithmConfig) -> (token_loss, stats)`."""
    return POLICY_LOSSES.register(name, override=override)


def get_advantage_estimator(name: str) -> Callable:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    return POLICY_LOSSES.get(name)


def uses_group_statistics(config: AlgorithmConfig) -> bool:
    """True when an advantage of `config` depends on the other samples of the same prompt:
    a group-based estimator, group-level normalisation, clip-filter weights or dynamic
    sampling. Such an algorithm must never train on a group with a missing (failed) member."""
    return (estimator_traits(config.adv.estimator).group_based
            or config.norm.level == "group" or bool(config.filters.clip_filter_weight)
            or bool(config.filters.dynamic_sampling))
