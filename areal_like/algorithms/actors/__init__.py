"""Thin actors: they prepare batches and hand loss functions to a `TrainEngine`.

The token-alignment convention every actor follows is documented in `actors/base.py`.
"""

from areal_like.algorithms.actors.critic import CriticActor
from areal_like.algorithms.actors.ppo import PPOActor
from areal_like.algorithms.actors.reinforce import ReinforceActor
from areal_like.algorithms.actors.sft import SFTActor

__all__ = ["CriticActor", "PPOActor", "ReinforceActor", "SFTActor"]
