"""areal-like: asynchronous, rollout/train-decoupled RL for language models."""

__version__ = "0.1.0"
