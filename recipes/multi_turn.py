"""Multi-turn RL: a wrong answer gets feedback and another try; reward discounted per turn.

    python -m areal_like.launcher.local multi_turn [key=value ...]
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from recipes.configs import MultiTurnConfig
from workflows import MultiTurnWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(MultiTurnConfig, "multi_turn_addition.yaml", argv)

    def workflow(rl: RLSetup, greedy: bool = False) -> MultiTurnWorkflow:
        return MultiTurnWorkflow(rl.task.reward_fn, config.gconfig.new(greedy=greedy),
                                 rl.tokenizer, config.max_turns, config.turn_discount,
                                 config.feedback)

    rl = RLSetup(config, eval_workflow=lambda rl: workflow(rl, greedy=True))
    actor = PPOActor(rl.actor_engine, config.algorithm)
    rl.track_state("actor", actor)  # KL coefficient, running statistics
    train_workflow = workflow(rl)

    def train_step(batch: TensorDict) -> dict[str, float]:  # one conversation per prompt
        return actor.update(actor.compute_advantages(batch))

    rl.train(train_workflow, train_step)


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
