"""Name -> function registries for advantage estimators and policy losses.

Users add their own with a decorator and select them by name in `AlgorithmConfig`:

    from areal_like.algorithms import register_advantage_estimator, AdvantageOutputs

    @register_advantage_estimator("my_baseline")
    def my_baseline(inputs, config):
        adv = inputs.seq_rewards - 0.5
        return AdvantageOutputs(advantages=broadcast_to_tokens(adv, inputs.loss_mask))

    AlgorithmConfig(adv_estimator="my_baseline")

Signatures: an advantage estimator is `fn(AdvantageInputs, AlgorithmConfig) ->
AdvantageOutputs` (see `estimators.py`); a policy loss is `fn(PolicyLossInputs,
AlgorithmConfig) -> (token_loss [T], stats)` (see `losses.py`).
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

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


def register_advantage_estimator(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering `fn(AdvantageInputs, AlgorithmConfig) -> AdvantageOutputs`."""
    return ADVANTAGE_ESTIMATORS.register(name, override=override)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering `fn(PolicyLossInputs, AlgorithmConfig) -> (token_loss, stats)`."""
    return POLICY_LOSSES.register(name, override=override)


def get_advantage_estimator(name: str) -> Callable:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    return POLICY_LOSSES.get(name)
