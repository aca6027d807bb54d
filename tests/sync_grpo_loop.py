"""A plain synchronous GRPO loop: the reference that `recipes/grpo.py` with eta = 0 must equal.

Each step draws the next prompts, generates them all with the current weights
(`rollout_batch`, which waits for every item), trains, and pushes the weights. Run like the
recipe (same config, same overrides); tests/test_recipes.py compares the two runs.
"""

from __future__ import annotations

from areal_like.algorithms import PPOActor
from areal_like.rollout.data_cursor import DataCursor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "grpo_addition.yaml", argv)
    rl = RLSetup(config)
    assert rl.rollout is not None, "the reference loop runs as a single process"
    actor = PPOActor(rl.actor_engine, config.algorithm)
    workflow = RLVRWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)
    data = DataCursor(rl.loader)

    for step in rl.steps():
        batch = rl.rollout.rollout_batch(data.next_items(), workflow)
        batch = actor.compute_advantages(batch)
        stats = actor.update(batch)
        stats |= rl.push_weights(step)
        rl.end_step(step, stats)
    rl.finish()


if __name__ == "__main__":
    main()
