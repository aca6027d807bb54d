"""ReMax: REINFORCE whose baseline is the reward of the greedy completion.

    python -m areal_like.launcher.local remax [key=value ...]
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from recipes.configs import GRPOConfig
from workflows import ReMaxWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "remax_addition.yaml", argv)
    rl = RLSetup(config)
    actor = PPOActor(rl.actor_engine, config.algorithm)  # remax estimator + reinforce loss
    rl.track_state("actor", actor)  # KL coefficient, running statistics
    workflow = ReMaxWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)

    def train_step(batch: TensorDict) -> dict[str, float]:
        # the batch holds rewards r(sample) and baseline_rewards r(greedy), generated together
        return actor.update(actor.compute_advantages(batch))

    rl.train(workflow, train_step)


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
