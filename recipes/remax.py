"""ReMax: REINFORCE whose baseline is the reward of the greedy completion.

    python -m areal_like.launcher.local remax [key=value ...]
"""

from __future__ import annotations

from areal_like.algorithms import PPOActor
from areal_like.runtime.cli import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from recipes.configs import GRPOConfig
from workflows import ReMaxWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "remax_addition.yaml", argv)
    rl = RLSetup(config)
    actor = PPOActor(rl.actor_engine, config.algorithm)  # remax estimator + reinforce loss
    workflow = ReMaxWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)

    for step in rl.steps():
        with rl.timing("rollout"):  # greedy and sampled completions, concurrently
            batch = rl.next_batch(workflow)  # rewards r(sample), baseline_rewards r(greedy)
        with rl.timing("train"):
            batch = actor.compute_advantages(batch)
            stats = actor.update(batch)
        with rl.timing("weight_sync"):
            stats |= rl.push_weights(step)
        rl.end_step(step, stats)
    rl.finish()


if __name__ == "__main__":
    main()
